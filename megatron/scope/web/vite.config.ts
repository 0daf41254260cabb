// Vite build of the MegaScope app into dist/, which is committed and ships with the Python package
// (the server serves it and the WebSocket on one port). Build with `python -m megatron.scope build-web`,
// which also writes dist/build-manifest.json, the sources this build was made from.
import { defineConfig } from "vitest/config";
import vue from "@vitejs/plugin-vue";

export default defineConfig({
  plugins: [vue()],
  base: "./",
  build: { outDir: "dist", emptyOutDir: true, chunkSizeWarningLimit: 800 },
  test: { environment: "jsdom", include: ["tests/**/*.test.ts"], setupFiles: ["tests/setup.ts"] },
});
