"""The policy tests run thousands of tiny tensor ops: one intra-op thread avoids the thread start-up and
spin-wait overhead that dominates them on a small, shared CPU (measured ~50x on 2 busy cores)."""

import torch

torch.set_num_threads(1)
