import os

import torch

# The Triton kernels run under the interpreter where there is no GPU; it must be chosen before
# triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# NOTE: tiny models on a 2-core machine: one torch thread avoids OpenMP threads spinning
# against each other (and against a second pytest process), which made small ops 100x slower.
torch.set_num_threads(1)

# NOTE: compiling the forward (torch.compile) takes 10-25 s per engine on two cores, and the suite
# builds hundreds of engines, in this process and in the services it starts (which inherit this).
# So the suite runs eager by default, as vLLM's CPU CI does; tests/integration/test_compiled_forward.py
# compiles on purpose (enforce_eager=False) and checks the compiled path against the eager one and
# against transformers.
os.environ.setdefault("PARKADE_ENFORCE_EAGER", "1")
