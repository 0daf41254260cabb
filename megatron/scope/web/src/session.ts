// Generation state assembled from server messages, plus the WebSocket connection that feeds it.
// The reducer functions are pure so component tests can drive them with hand-made frames.
import { reactive } from "vue";
import { decodeFrame, vectorAt, type Frame } from "./protocol";

export const VECTOR_KINDS = ["qkv", "fc1", "fc2", "layer"] as const;
export type VectorKind = (typeof VECTOR_KINDS)[number];

export interface Candidate { id: number; text: string; prob: number }
export interface StepInfo { step: number; sampled: Candidate; topk: Candidate[] }
export interface SampleState {
  tokens: { id: number; text: string }[];
  steps: StepInfo[];
  vectors: Record<string, Float32Array[][]>; // kind -> layer -> position -> bins
  attention: Float32Array[][][]; // layer -> head -> query position -> keys
  lens: Candidate[][][]; // layer -> position -> top-k
}
export interface ModelInfo {
  num_layers: number; hidden_size: number; num_heads: number; ffn_hidden_size: number;
  vocab_size: number; max_positions: number; tp: number; pp: number; name: string;
}
export interface PcaView { layer: number; points: number[][]; labels: { sample: number; position: number; text: string }[]; explained: number[] }
export interface TrainPoint { iteration: number; loss: number | null; grad_norm: number | null; layer_grad_norms: number[] }
export interface TrainingState { iteration: number; paused: boolean; history: TrainPoint[]; sample: string; running: boolean }

export interface ScopeState {
  status: "connecting" | "open" | "closed";
  mode: string;
  model: ModelInfo | null;
  hello: Record<string, any> | null;
  busy: boolean;
  request: number;
  samples: SampleState[];
  texts: string[];
  dropped: number;
  pca: PcaView | null;
  training: TrainingState | null;
  errors: string[];
  stepsSeen: number;
  lastDone: number | null; // request id of the latest finished generation
}

export function emptyState(): ScopeState {
  return { status: "connecting", mode: "generate", model: null, hello: null, busy: false, request: 0,
    samples: [], texts: [], dropped: 0, pca: null, training: null, errors: [], stepsSeen: 0, lastDone: null };
}

function emptySample(): SampleState {
  return { tokens: [], steps: [], vectors: {}, attention: [], lens: [] };
}

function candidate(entry: [number, string, number]): Candidate {
  return { id: entry[0], text: entry[1], prob: entry[2] };
}

export function applyJson(state: ScopeState, message: Record<string, any>): void {
  switch (message.type) {
    case "hello":
      state.hello = message; state.model = message.model; state.mode = message.mode;
      if (message.training) state.training = { history: [], sample: "", running: false, ...message.training };
      break;
    case "start":
      state.request = message.request;
      state.samples = (message.prompts as [number, string][][]).map(() => emptySample());
      state.texts = []; state.pca = null; state.busy = true; state.stepsSeen = 0;
      break;
    case "done":
      state.busy = false; state.texts = message.texts; state.dropped = message.dropped ?? 0;
      state.lastDone = message.request;
      (message.tokens as [number, string][][]).forEach((tokens, b) => {
        if (!state.samples[b]) return;
        // Step frames may have been dropped under load; the summary fills in every token.
        state.samples[b].tokens = tokens.map(([id, text]) => ({ id, text }));
      });
      break;
    case "pca":
      state.pca = { layer: message.layer, points: message.points, labels: message.labels, explained: message.explained };
      break;
    case "train_status":
      state.training = { ...(state.training ?? { history: [], sample: "", running: false }), ...message.training };
      break;
    case "train_metrics":
      if (state.training) {
        state.training.history.push(message.point);
        if (state.training.history.length > 500) state.training.history.shift();
        state.training.iteration = message.point.iteration;
      }
      break;
    case "error":
      state.errors.push(`${message.code}: ${message.message}`);
      if (state.errors.length > 20) state.errors.shift();
      if (message.code === "failed") state.busy = false;
      break;
  }
}

export function applyFrame(state: ScopeState, frame: Frame): void {
  const { header, arrays } = frame;
  if (header.type !== "step") return;
  state.stepsSeen += 1;
  header.samples.forEach((sample: any, b: number) => {
    const target = state.samples[b] ?? (state.samples[b] = emptySample());
    const positions: number[] = header.positions[b];
    sample.positions.forEach((position: number, j: number) => {
      const [id, text] = sample.tokens[j];
      target.tokens[position] = { id, text };
    });
    target.steps.push({ step: header.step, sampled: sample.sampled, topk: sample.topk.map(candidate) });
    for (const kind of VECTOR_KINDS) {
      const array = arrays[kind];
      if (!array) continue; // [layers, batch, positions, bins]
      const perLayer = (target.vectors[kind] ??= []);
      for (let layer = 0; layer < array.shape[0]; layer++) {
        const rows = (perLayer[layer] ??= []);
        positions.forEach((position, j) => {
          if (position < sample.length) rows[position] = vectorAt(array, [layer, b, j]);
        });
      }
    }
    const attention = arrays.attention; // [layers, batch, heads, positions, keys]
    if (attention) {
      for (let layer = 0; layer < attention.shape[0]; layer++) {
        const heads = (target.attention[layer] ??= []);
        for (let head = 0; head < attention.shape[2]; head++) {
          const rows = (heads[head] ??= []);
          positions.forEach((position, j) => {
            if (position < sample.length) rows[position] = vectorAt(attention, [layer, b, head, j]).subarray(0, position + 1);
          });
        }
      }
    }
    const ids = arrays.lens_ids, probs = arrays.lens_probs; // [layers, batch, positions, k]
    if (ids && probs) {
      const k = ids.shape[3];
      for (let layer = 0; layer < ids.shape[0]; layer++) {
        const rows = (target.lens[layer] ??= []);
        positions.forEach((position, j) => {
          if (position >= sample.length) return;
          const base = ((layer * ids.shape[1] + b) * ids.shape[2] + j) * k;
          rows[position] = Array.from({ length: k }, (_, i) => {
            const id = ids.data[base + i];
            return { id, text: header.lens_vocab?.[String(id)] ?? `<${id}>`, prob: probs.data[base + i] };
          });
        });
      }
    }
  });
}

export interface Connection { send(message: Record<string, any>): boolean; close(): void }

/** Opens the WebSocket on the page's own host with the token from the page URL. */
export function connect(state: ScopeState, location: Location = window.location): Connection {
  const token = new URLSearchParams(location.search).get("token") ?? "";
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const socket = new WebSocket(`${scheme}://${location.host}/ws?token=${encodeURIComponent(token)}`);
  socket.binaryType = "arraybuffer";
  socket.onopen = () => { state.status = "open"; };
  socket.onclose = () => { state.status = "closed"; state.busy = false; };
  socket.onmessage = (event) => {
    if (typeof event.data === "string") applyJson(state, JSON.parse(event.data));
    else applyFrame(state, decodeFrame(event.data as ArrayBuffer));
  };
  return {
    send(message) {
      if (socket.readyState !== WebSocket.OPEN) return false;
      socket.send(JSON.stringify(message));
      return true;
    },
    close() { socket.close(); },
  };
}

export function createState(): ScopeState {
  return reactive(emptyState()) as ScopeState;
}
