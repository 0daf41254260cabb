import { describe, expect, it } from "vitest";
import { decodeFrame, encodeFrame, floatToHalf, halfToFloat, vectorAt } from "../src/protocol";

describe("binary frames", () => {
  it("round-trips a header and float16 arrays", () => {
    const values = [0, 1, -2, 0.5, 3.25, -65504, 1e-3, 42];
    const frame = decodeFrame(encodeFrame({ type: "step", step: 3 }, { a: { shape: [2, 4], values } }));
    expect(frame.header.type).toBe("step");
    expect(frame.header.step).toBe(3);
    expect(frame.arrays.a.shape).toEqual([2, 4]);
    Array.from(frame.arrays.a.data).forEach((v, i) => expect(v).toBeCloseTo(values[i], 3));
    expect(Array.from(vectorAt(frame.arrays.a, [1]))[3]).toBe(42);
  });

  it("decodes float16 special values", () => {
    expect(halfToFloat(0x3c00)).toBe(1);
    expect(halfToFloat(0xc000)).toBe(-2);
    expect(halfToFloat(0x7c00)).toBe(Infinity);
    expect(Number.isNaN(halfToFloat(0x7e00))).toBe(true);
    expect(halfToFloat(0x0001)).toBeCloseTo(5.96e-8, 10);
    expect(floatToHalf(1)).toBe(0x3c00);
  });

  it("rejects what is not a frame", () => {
    expect(() => decodeFrame(new Uint8Array([1, 2, 3, 4, 5, 6, 7, 8]).buffer)).toThrow(/not a MegaScope frame/);
  });

  it("reads the exact bytes the Python encoder writes", () => {
    // megatron.scope.codec.encode_frame({"type":"t"}, {"x": np.array([1.0, -0.5], np.float32)})
    const header = '{"type":"t","arrays":[{"name":"x","dtype":"f16","shape":[2],"offset":0}]}';
    const text = new TextEncoder().encode(header);
    const pad = (8 - ((8 + text.length) % 8)) % 8;
    const bytes = new Uint8Array(8 + text.length + pad + 8);
    bytes.set([0x4d, 0x53, 0x43, 0x31]);
    new DataView(bytes.buffer).setUint32(4, text.length, true);
    bytes.set(text, 8);
    new DataView(bytes.buffer).setUint16(8 + text.length + pad, 0x3c00, true);
    new DataView(bytes.buffer).setUint16(8 + text.length + pad + 2, 0xb800, true);
    expect(Array.from(decodeFrame(bytes.buffer).arrays.x.data)).toEqual([1, -0.5]);
  });
});
