import { describe, expect, it } from "vitest";
import { decodeFrame, encodeFrame } from "../src/protocol";
import { applyFrame, applyJson, emptyState } from "../src/session";
import { parseIndices, toMessage, newPerturbation } from "../src/perturbations";

function stepFrame(step: number, positions: number[][], lengths: number[], layers = 2, bins = 3) {
  const batch = positions.length, n = positions[0].length;
  const values = (count: number, base: number) => Array.from({ length: count }, (_, i) => base + i / 100);
  return decodeFrame(encodeFrame({
    type: "step", request: 1, step, positions,
    samples: positions.map((rows, b) => ({
      length: lengths[b], positions: rows.filter((p) => p < lengths[b]),
      tokens: rows.filter((p) => p < lengths[b]).map((p) => [100 + p, `t${p}`]),
      sampled: { id: 7, text: "x", prob: 0.5 }, topk: [[7, "x", 0.5], [8, "y", 0.25]],
    })),
    lens_vocab: { "7": "x" },
  }, {
    layer: { shape: [layers, batch, n, bins], values: values(layers * batch * n * bins, step) },
    attention: { shape: [layers, batch, 2, n, Math.max(...lengths)], values: values(layers * batch * 2 * n * Math.max(...lengths), 0) },
  }));
}

describe("session reducer", () => {
  it("assembles tokens, vectors, attention rows and steps from streamed frames", () => {
    const state = emptyState();
    applyJson(state, { type: "start", request: 1, prompts: [[[1, "a"], [2, "b"], [3, "c"]], [[4, "d"]]] });
    expect(state.busy).toBe(true);
    applyFrame(state, stepFrame(0, [[0, 1, 2], [0, 1, 2]], [3, 1]));
    expect(state.samples[0].tokens.map((t) => t.text)).toEqual(["t0", "t1", "t2"]);
    expect(state.samples[1].tokens.length).toBe(1); // padding positions are ignored
    expect(state.samples[0].vectors.layer[1].length).toBe(3);
    expect(state.samples[0].attention[0][1][2].length).toBe(3); // query 2 sees keys 0..2
    applyFrame(state, stepFrame(1, [[3], [1]], [4, 2]));
    expect(state.samples[0].vectors.layer[0][3][0]).toBeCloseTo(1, 2);
    expect(state.samples[1].steps.map((s) => s.step)).toEqual([0, 1]);
    expect(state.samples[0].steps[0].topk[1]).toEqual({ id: 8, text: "y", prob: 0.25 });
    applyJson(state, { type: "done", request: 1, texts: ["abcx", "dx"], tokens: [[[1, "a"]], [[4, "d"]]], dropped: 2 });
    expect(state.busy).toBe(false);
    expect(state.dropped).toBe(2);
  });

  it("keeps hello, pca, training metrics and errors", () => {
    const state = emptyState();
    applyJson(state, { type: "hello", mode: "train", model: { num_layers: 2 }, training: { iteration: 3, paused: true } });
    expect(state.mode).toBe("train");
    expect(state.training?.paused).toBe(true);
    applyJson(state, { type: "train_metrics", point: { iteration: 4, loss: 2.5, grad_norm: 1, layer_grad_norms: [1, 2] } });
    expect(state.training?.iteration).toBe(4);
    applyJson(state, { type: "pca", layer: 1, points: [[0, 1]], labels: [{ sample: 0, position: 0, text: "a" }], explained: [0.9, 0.1] });
    expect(state.pca?.layer).toBe(1);
    applyJson(state, { type: "error", code: "bad_request", message: "nope" });
    expect(state.errors).toEqual(["bad_request: nope"]);
  });
});

describe("perturbation rows", () => {
  it("parses index lists and ranges", () => {
    expect(parseIndices("")).toEqual([]);
    expect(parseIndices("3, 0-2, 2")).toEqual([0, 1, 2, 3]);
    expect(() => parseIndices("1;2")).toThrow();
    expect(() => parseIndices("5-1")).toThrow();
  });

  it("turns a row into the wire form", () => {
    const row = { ...newPerturbation(), kind: "system", type: "offset", intensity: 2, layers: "1", tokenStart: "2", tokenEnd: "5" };
    expect(toMessage(row)).toEqual({ enabled: true, kind: "system", type: "offset", intensity: 2, seed: 0,
      layers: [1], heads: [], tokens: [2, 5] });
  });
});
