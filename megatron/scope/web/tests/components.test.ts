import { describe, expect, it } from "vitest";
import { mount } from "@vue/test-utils";
import { nextTick, reactive } from "vue";
import TopKList from "../src/components/TopKList.vue";
import HeatmapCanvas from "../src/components/HeatmapCanvas.vue";
import PerturbationPanel from "../src/components/PerturbationPanel.vue";
import AttentionView from "../src/components/AttentionView.vue";
import TrainingPanel from "../src/components/TrainingPanel.vue";
import { emptyState } from "../src/session";

describe("components", () => {
  it("TopKList expands a step to show its alternatives", async () => {
    const steps = [{ step: 0, sampled: { id: 1, text: " the", prob: 0.61 }, topk: [
      { id: 1, text: " the", prob: 0.61 }, { id: 2, text: " a", prob: 0.2 }] }];
    const wrapper = mount(TopKList, { props: { steps } });
    expect(wrapper.text()).toContain("61.00%");
    expect(wrapper.find('[data-testid="topk-alternatives"]').exists()).toBe(false);
    await wrapper.find("button").trigger("click");
    expect(wrapper.findAll('[data-testid="topk-alternatives"] li').length).toBe(2);
  });

  it("HeatmapCanvas counts the rows it has and reports the colour limit", async () => {
    const wrapper = mount(HeatmapCanvas, { props: { rows: [new Float32Array([1, -3]), undefined, new Float32Array([2, 0])], labels: ["a", "b", "c"] } });
    await nextTick();
    expect(wrapper.find("canvas").attributes("data-rows")).toBe("2");
    expect(wrapper.text()).toContain("3.00");
  });

  it("PerturbationPanel adds and removes rows through v-model", async () => {
    const wrapper = mount(PerturbationPanel, { props: { modelValue: [], kinds: ["storage", "system"], types: ["gaussian"],
      "onUpdate:modelValue": (rows: unknown[]) => wrapper.setProps({ modelValue: rows as never }) } });
    await wrapper.find('[data-testid="perturbation-add"]').trigger("click");
    expect(wrapper.findAll('[data-testid="perturbation-row"]').length).toBe(1);
    expect(wrapper.findAll('[data-testid="perturbation-kind"] option').map((o) => o.text())).toEqual(["storage", "system"]);
  });

  it("AttentionView offers one option per layer and head", () => {
    const state = reactive(emptyState());
    state.model = { num_layers: 3, hidden_size: 8, num_heads: 2, ffn_hidden_size: 32, vocab_size: 10, max_positions: 16, tp: 1, pp: 1, name: "m" };
    const wrapper = mount(AttentionView, { props: { state } });
    expect(wrapper.findAll('[data-testid="attention-layer"] option').length).toBe(3);
    expect(wrapper.findAll('[data-testid="attention-head"] option').length).toBe(2);
  });

  it("TrainingPanel emits start/pause/step and shows per-layer gradient norms", async () => {
    const state = reactive(emptyState());
    state.training = { iteration: 5, paused: true, sample: "", running: false,
      history: [{ iteration: 5, loss: 3.2, grad_norm: 1.5, layer_grad_norms: [0.5, 1.0] }] };
    const wrapper = mount(TrainingPanel, { props: { state } });
    expect(wrapper.text()).toContain("paused");
    expect(wrapper.findAll('[data-testid="grad-norm"]').length).toBe(2);
    await wrapper.find('[data-testid="train-step"]').trigger("click");
    await wrapper.find('[data-testid="train-start"]').trigger("click");
    expect(wrapper.emitted("action")!.map((e) => e[0])).toEqual(["step", "start"]);
  });
});
