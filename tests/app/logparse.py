"""Read the trainer's Megatron-style log lines back into numbers."""
import re

LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|")
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")


def losses(text: str) -> dict[int, str]:
    """{iteration: loss as printed} — compared as strings for exact equality."""
    return {int(m.group(1)): m.group(2) for m in LINE.finditer(text)}


def validation_losses(text: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in VALIDATION.finditer(text)}
