// Training tab check in Debian's chromium: the page of a paused pretrain_gpt.py --training-ws-port
// run; click "step", see the iteration advance, the loss curve and per-layer gradient norms.
//   node e2e/training.e2e.mjs URL ARTIFACT_DIR EXPECTED_ITERATION
import { mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

const [url, artifacts, expected] = process.argv.slice(2);
mkdirSync(artifacts, { recursive: true });
const profile = mkdtempSync(join(tmpdir(), "megascope-chromium-"));
const browser = await chromium.launchPersistentContext(profile, {
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  viewport: { width: 1400, height: 900 },
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
try {
  const page = browser.pages()[0] ?? (await browser.newPage());
  await page.goto(url);
  await page.waitForFunction(() => document.querySelector('[data-testid="status"]')?.textContent === "open");
  await page.getByTestId("tab-training").click();
  await page.getByTestId("train-step").click();
  await page.waitForFunction((it) => document.querySelector('[data-testid="train-status"]')?.textContent?.includes(`iteration ${it}`), expected);
  await page.getByTestId("grad-norm").first().waitFor();
  const norms = await page.getByTestId("grad-norm").count();
  if (norms < 1) throw new Error("no gradient norms shown");
  await page.screenshot({ path: join(artifacts, "training.png"), fullPage: true });
  await page.getByTestId("tab-vectors").click();
  await page.getByTestId("heatmap-canvas").first().waitFor();
  await page.screenshot({ path: join(artifacts, "training-sample.png"), fullPage: true });
  console.log(JSON.stringify({ ok: true, norms }));
} catch (error) {
  console.log(JSON.stringify({ ok: false, error: String(error) }));
  process.exitCode = 1;
} finally {
  await browser.close();
  rmSync(profile, { recursive: true, force: true });
}
