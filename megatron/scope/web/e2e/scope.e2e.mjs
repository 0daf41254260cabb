// End-to-end check of the MegaScope app in Debian's chromium, driven by playwright-core:
//   node e2e/scope.e2e.mjs URL ARTIFACT_DIR
// Types prompts, generates, checks heatmaps / top-k / attention / PCA / logit lens, enables a
// perturbation and checks that the probabilities change. Saves a screenshot of each view.
import { mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

const [url, artifacts] = process.argv.slice(2);
// Two prompts, one batch; MEGASCOPE_PROMPTS='["a", "b"]' swaps in others (e.g. for the docs' demo model).
const prompts = JSON.parse(process.env.MEGASCOPE_PROMPTS || '["Hello MegaScope", "Attention please"]');
if (!url || !artifacts) {
  console.error("usage: node e2e/scope.e2e.mjs URL ARTIFACT_DIR");
  process.exit(2);
}
mkdirSync(artifacts, { recursive: true });
const profile = mkdtempSync(join(tmpdir(), "megascope-chromium-"));
// A fresh profile directory per run (playwright passes it as --user-data-dir).
const browser = await chromium.launchPersistentContext(profile, {
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  viewport: { width: 1400, height: 900 },
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const checks = [];
function check(name, ok, detail = "") {
  checks.push({ name, ok, detail });
  if (!ok) throw new Error(`check failed: ${name} ${detail}`);
}

try {
  const page = browser.pages()[0] ?? (await browser.newPage());
  page.on("pageerror", (error) => console.error("page error:", error.message));
  await page.goto(url);
  const byId = (id) => page.getByTestId(id);
  await page.waitForFunction(() => document.querySelector('[data-testid="status"]')?.textContent === "open");
  check("connected", true);
  await byId("prompt-0").fill(prompts[0]);
  await byId("add-prompt").click();
  await byId("prompt-1").fill(prompts[1]);
  await byId("max-new-tokens").fill("6");
  const finished = (request) => page.waitForFunction((id) => {
    const steps = document.querySelector('[data-testid="steps-seen"]');
    return steps?.dataset.done === String(id) && steps.textContent === "6 steps";
  }, request);
  await byId("generate").click();
  await finished(1);
  await byId("texts").waitFor();
  const rows = await page.$$eval('[data-testid="heatmap-canvas"]', (cs) => cs.map((c) => Number(c.dataset.rows)));
  check("a heatmap per prompt, filled", rows.length === 2 && rows.every((r) => r >= 7), JSON.stringify(rows));
  check("top-k per generated step", (await byId("topk-step").count()) === 12);
  await byId("topk-step").first().locator("button").click();
  check("top-k expands", (await byId("topk-alternatives").locator("li").count()) === 5);
  await byId("vector-kind").selectOption("fc1");
  await byId("vector-layer").selectOption("1");
  await page.screenshot({ path: join(artifacts, "vectors.png"), fullPage: true });

  await byId("tab-attention").click();
  await byId("attention-layer").selectOption("2");
  await byId("attention-head").selectOption("1");
  await byId("attention-sample").selectOption("1");
  const attentionRows = await page.$eval('[data-testid="heatmap-canvas"]', (c) => Number(c.dataset.rows));
  check("attention matrix for layer 2 head 1", attentionRows >= 7, String(attentionRows));
  await page.screenshot({ path: join(artifacts, "attention.png"), fullPage: true });

  await byId("tab-pca").click();
  await byId("pca-layer").selectOption("1");
  await page.waitForFunction(() => Number(document.querySelector('[data-testid="pca-canvas"]')?.dataset.points) > 0);
  const explained = await byId("pca-explained").textContent();
  check("PCA plot with explained variance", /layer 1: PC1 [\d.]+%/.test(explained ?? ""), explained ?? "");
  await page.screenshot({ path: join(artifacts, "pca.png"), fullPage: true });

  await byId("tab-logit-lens").click();
  await byId("lens-table").waitFor();
  check("logit lens rows per layer", (await byId("lens-table").locator("tbody tr").count()) >= 3);
  await page.screenshot({ path: join(artifacts, "logit-lens.png"), fullPage: true });

  await byId("tab-vectors").click();
  const probBefore = await byId("sampled-prob").first().textContent();
  await byId("perturbation-add").click();
  await byId("perturbation-kind").selectOption("system");
  await byId("perturbation-type").selectOption("gaussian");
  await byId("perturbation-intensity").fill("2");
  await byId("generate").click();
  await finished(2);
  const probAfter = await byId("sampled-prob").first().textContent();
  check("perturbation changes the probabilities", probBefore !== probAfter, `${probBefore} -> ${probAfter}`);
  await byId("topk-step").first().locator("button").click();
  await page.screenshot({ path: join(artifacts, "perturbed.png"), fullPage: true });
  const errors = await byId("error").count();
  check("no error frames", errors === 0);
  console.log(JSON.stringify({ ok: true, checks }));
} catch (error) {
  console.log(JSON.stringify({ ok: false, checks, error: String(error) }));
  process.exitCode = 1;
} finally {
  await browser.close();
  rmSync(profile, { recursive: true, force: true });
}
