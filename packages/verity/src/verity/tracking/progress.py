"""Console progress for a training loop: a live bar on a terminal, sparse lines otherwise.

On a TTY, a tqdm bar shows the step count, rate and ETA plus a few live
metrics (``reward 0.512 acc 0.48 len 23.4 kl 1.2e-03 tok/s 15.2k``). When the
stream is not a TTY (CI logs, ``| tee``), a plain line is printed for the first
step, every ``every`` steps, the last step, and any step that ends more than
``min_interval_s`` after the last line (so slow runs show every step), keeping logs
short but never silent for long. :meth:`ProgressLine.note` prints a line between
steps (validation started and finished).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from verity.tracking.names import PROGRESS_KEYS, SHORT_LABELS


def format_value(value: float) -> str:
    """Compact number: 15234 → "15.2k", 0.00123 → "1.2e-03", 0.51234 → "0.512"."""
    value = float(value)
    magnitude = abs(value)
    if magnitude != magnitude:  # NaN
        return "nan"
    if magnitude >= 1e6:
        return f"{value / 1e6:.1f}M"
    if magnitude >= 1e4:
        return f"{value / 1e3:.1f}k"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude == 0 or magnitude >= 1e-2:
        return f"{value:.3g}"
    return f"{value:.1e}"


def format_metrics(metrics: Mapping[str, Any], keys: Sequence[str]) -> str:
    """``label value`` pairs for the ``keys`` present in ``metrics``, in order of ``keys``."""
    parts = []
    for key in keys:
        value = metrics.get(key)
        if value is None:
            continue
        number = value.item() if hasattr(value, "item") else value
        parts.append(f"{SHORT_LABELS.get(key, key)} {format_value(number)}")
    return " ".join(parts)


class ProgressLine:
    """Progress of ``total_steps`` steps with live metrics.

    Args:
        total_steps: steps in the run (> 0).
        keys: metric names to show (default: reward, acc, length, kl, tokens/s).
        stream: where to write (default sys.stderr).
        every: when the stream is not a TTY, print every ``every`` steps (> 0).
        min_interval_s: when the stream is not a TTY, also print any step ending this many
            seconds after the last printed line.
        live: force the bar on (True) or off (False); None decides by ``stream.isatty()``.
        desc: label before the bar / line.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        keys: Sequence[str] = PROGRESS_KEYS,
        stream: TextIO | None = None,
        every: int = 10,
        min_interval_s: float = 30.0,
        live: bool | None = None,
        desc: str = "train",
    ) -> None:
        if not isinstance(total_steps, int) or total_steps <= 0:
            raise ValueError(f"total_steps must be an int > 0, got {total_steps!r}")
        if not isinstance(every, int) or every <= 0:
            raise ValueError(f"every must be an int > 0, got {every!r}")
        self.total_steps = total_steps
        self.keys = tuple(keys)
        self.stream = stream if stream is not None else sys.stderr
        self.every = every
        self.min_interval_s = min_interval_s
        self.desc = desc
        isatty = getattr(self.stream, "isatty", None)
        self.live = bool(isatty()) if live is None and callable(isatty) else bool(live)
        self._started = time.perf_counter()
        self._last_line = self._started
        self._bar = None
        if self.live:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, desc=desc, file=self.stream, dynamic_ncols=True, leave=True)

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Record that ``step`` (1-based, <= total_steps) steps are done, with their metrics."""
        if not isinstance(step, int) or not 1 <= step <= self.total_steps:
            raise ValueError(f"step must be an int in 1..{self.total_steps}, got {step!r}")
        text = format_metrics(metrics or {}, self.keys)
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.refresh()
            return
        now = time.perf_counter()
        slow = now - self._last_line >= self.min_interval_s
        if step == 1 or step % self.every == 0 or step == self.total_steps or slow:
            line = f"{self.desc} step {step}/{self.total_steps} [{now - self._started:.0f}s]"
            print(f"{line} {text}".rstrip(), file=self.stream, flush=True)
            self._last_line = now

    def note(self, message: str) -> None:
        """Print one line between steps (e.g. ``validating at step 100``), above the bar on a TTY."""
        elapsed = time.perf_counter() - self._started
        line = f"{self.desc} [{elapsed:.0f}s] {message}"
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)
            self._last_line = time.perf_counter()

    def close(self) -> None:
        """Finish the bar (no-op for plain lines)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
