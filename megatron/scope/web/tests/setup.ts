// jsdom has no canvas backend: answer null quietly so components skip drawing.
HTMLCanvasElement.prototype.getContext = (() => null) as unknown as HTMLCanvasElement["getContext"];
