// Perturbation rows as edited in the panel, and their wire form (the server validates again).

export interface PerturbationRow {
  enabled: boolean; kind: string; type: string; intensity: number; seed: number;
  layers: string; heads: string; tokenStart: string; tokenEnd: string;
}

export function newPerturbation(): PerturbationRow {
  return { enabled: true, kind: "calculation", type: "gaussian", intensity: 0.5, seed: 0,
    layers: "", heads: "", tokenStart: "", tokenEnd: "" };
}

/** "0, 2-4" -> [0, 2, 3, 4]; empty -> [] (all). Throws on anything else. */
export function parseIndices(text: string): number[] {
  const out = new Set<number>();
  for (const part of text.split(",").map((p) => p.trim()).filter(Boolean)) {
    const range = part.split("-").map((p) => p.trim());
    if (range.length > 2 || range.some((p) => !/^\d+$/.test(p))) throw new Error(`not an index or range: ${part}`);
    const [a, b] = [Number(range[0]), Number(range[range.length - 1])];
    if (b < a || b - a > 4096) throw new Error(`bad range: ${part}`);
    for (let i = a; i <= b; i++) out.add(i);
  }
  return [...out].sort((x, y) => x - y);
}

export function toMessage(row: PerturbationRow): Record<string, unknown> {
  const message: Record<string, unknown> = {
    enabled: row.enabled, kind: row.kind, type: row.type, intensity: Number(row.intensity),
    seed: Math.trunc(Number(row.seed)), layers: parseIndices(row.layers), heads: parseIndices(row.heads),
  };
  if (row.tokenStart !== "" || row.tokenEnd !== "") {
    message.tokens = [Number(row.tokenStart || 0), Number(row.tokenEnd || 100000)];
  }
  return message;
}
