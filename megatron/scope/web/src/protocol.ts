// Wire format shared with megatron/scope/codec.py: "MSC1", uint32 header length, JSON header,
// padding to 8 bytes, then float16/int32 arrays each 8-byte aligned.

export interface ArrayEntry { name: string; dtype: "f16" | "f32" | "i32"; shape: number[]; offset: number }
export interface NdArray { shape: number[]; data: Float32Array | Int32Array }
export interface Frame { header: Record<string, any>; arrays: Record<string, NdArray> }

const MAGIC = [0x4d, 0x53, 0x43, 0x31];

// float16 -> float32 for every 16-bit pattern, built once (no Float16Array on older engines).
const HALF_TABLE = (() => {
  const table = new Float32Array(65536);
  for (let bits = 0; bits < 65536; bits++) {
    const sign = bits & 0x8000 ? -1 : 1;
    const exponent = (bits >> 10) & 0x1f;
    const fraction = bits & 0x3ff;
    if (exponent === 0) table[bits] = sign * 2 ** -14 * (fraction / 1024);
    else if (exponent === 31) table[bits] = fraction ? NaN : sign * Infinity;
    else table[bits] = sign * 2 ** (exponent - 15) * (1 + fraction / 1024);
  }
  return table;
})();

export function halfToFloat(bits: number): number {
  return HALF_TABLE[bits & 0xffff];
}

export function decodeFrame(buffer: ArrayBuffer): Frame {
  const bytes = new Uint8Array(buffer);
  if (bytes.length < 8 || MAGIC.some((b, i) => bytes[i] !== b)) throw new Error("not a MegaScope frame");
  const length = new DataView(buffer).getUint32(4, true);
  if (8 + length > bytes.length) throw new Error("frame header runs past the frame");
  const header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + length)));
  const start = 8 + length + ((8 - ((8 + length) % 8)) % 8);
  const arrays: Record<string, NdArray> = {};
  for (const entry of (header.arrays ?? []) as ArrayEntry[]) {
    const count = entry.shape.reduce((a, b) => a * b, 1);
    const begin = start + entry.offset;
    if (entry.dtype === "f16") {
      const raw = new Uint16Array(buffer, begin, count);
      const data = new Float32Array(count);
      for (let i = 0; i < count; i++) data[i] = HALF_TABLE[raw[i]];
      arrays[entry.name] = { shape: entry.shape, data };
    } else if (entry.dtype === "i32") {
      arrays[entry.name] = { shape: entry.shape, data: new Int32Array(buffer.slice(begin, begin + count * 4)) };
    } else {
      arrays[entry.name] = { shape: entry.shape, data: new Float32Array(buffer.slice(begin, begin + count * 4)) };
    }
  }
  return { header, arrays };
}

/** The contiguous innermost vector at `index` (all but the last dimension) of an array. */
export function vectorAt(array: NdArray, index: number[]): Float32Array {
  const shape = array.shape;
  let offset = 0;
  for (let d = 0; d < index.length; d++) offset = offset * shape[d] + index[d];
  const width = shape.slice(index.length).reduce((a, b) => a * b, 1);
  return Float32Array.from(array.data.subarray(offset * width, (offset + 1) * width));
}

// Encoding used by tests (and handy for fixtures): float32 -> float16 bits, round to nearest.
export function floatToHalf(value: number): number {
  const f32 = new Float32Array([value]);
  const bits = new Uint32Array(f32.buffer)[0];
  const sign = (bits >> 16) & 0x8000;
  const exponent = ((bits >> 23) & 0xff) - 127 + 15;
  let mantissa = bits & 0x7fffff;
  if (exponent <= 0) {
    if (exponent < -10) return sign;
    mantissa = (mantissa | 0x800000) >> (1 - exponent);
    return sign | ((mantissa + 0x1000) >> 13);
  }
  if (exponent >= 31) return sign | 0x7c00;
  const rounded = sign | (exponent << 10) | ((mantissa + 0x1000) >> 13);
  return rounded;
}

export function encodeFrame(header: Record<string, any>, arrays: Record<string, { shape: number[]; values: number[] }>): ArrayBuffer {
  const entries: ArrayEntry[] = [];
  const blobs: Uint8Array[] = [];
  let offset = 0;
  for (const [name, { shape, values }] of Object.entries(arrays)) {
    const half = new Uint16Array(values.map(floatToHalf));
    const raw = new Uint8Array(half.buffer);
    const padded = new Uint8Array(raw.length + ((8 - (raw.length % 8)) % 8));
    padded.set(raw);
    entries.push({ name, dtype: "f16", shape, offset });
    blobs.push(padded);
    offset += padded.length;
  }
  const text = new TextEncoder().encode(JSON.stringify({ ...header, arrays: entries }));
  const headPad = (8 - ((8 + text.length) % 8)) % 8;
  const out = new Uint8Array(8 + text.length + headPad + offset);
  out.set(MAGIC, 0);
  new DataView(out.buffer).setUint32(4, text.length, true);
  out.set(text, 8);
  out.fill(0x20, 8 + text.length, 8 + text.length + headPad);
  let at = 8 + text.length + headPad;
  for (const blob of blobs) { out.set(blob, at); at += blob.length; }
  return out.buffer;
}
