import os

import torch

# The Triton kernels run under the interpreter where there is no GPU; it must be chosen before
# triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# NOTE: tiny models on a 2-core machine: one torch thread avoids OpenMP threads spinning
# against each other (and against a second pytest process), which made small ops 100x slower.
torch.set_num_threads(1)
