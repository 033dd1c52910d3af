"""Shared test set-up: W&B off, few threads, repo root importable."""
import os
import sys

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
