// Colour scales for heatmaps: diverging blue-white-red for signed values, white-to-ink for probabilities.

export function divergingColor(value: number, limit: number): string {
  const t = limit > 0 ? Math.max(-1, Math.min(1, value / limit)) : 0;
  const low = [33, 102, 172], mid = [247, 247, 247], high = [178, 24, 43];
  const [a, b, s] = t < 0 ? [mid, low, -t] : [mid, high, t];
  return `rgb(${a.map((c, i) => Math.round(c + (b[i] - c) * s)).join(",")})`;
}

export function sequentialColor(value: number, limit: number): string {
  const t = limit > 0 ? Math.max(0, Math.min(1, value / limit)) : 0;
  const from = [255, 255, 255], to = [8, 48, 107];
  return `rgb(${from.map((c, i) => Math.round(c + (to[i] - c) * t)).join(",")})`;
}

export const SAMPLE_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"];
