"""`tessera train --profile A:B --profile-torch`: torch.profiler over the recorded steps beside
Tessera's own intervals, each rank's operators (and CUDA kernels on a GPU) written as a Chrome trace
to run_dir/profile/torch_rank<R>.json when step B ends (or training ends inside the window). Open
it in ui.perfetto.dev or chrome://tracing; it is large (every operator), so keep the window short."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


class TorchTrace:
    """One rank's torch.profiler for the window: `start` at each recorded step (only the first
    starts it), `stop` at the last (writes the file; once)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.profiler: profile | None = None
        self.done = False

    def start(self) -> None:
        if self.profiler is not None or self.done:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.profiler = profile(activities=activities, record_shapes=False)
        self.profiler.__enter__()

    def stop(self) -> None:
        if self.profiler is None:
            return
        profiler, self.profiler, self.done = self.profiler, None, True
        profiler.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.path))
