import torch

# NOTE: tiny models on a 2-core machine: one torch thread avoids OpenMP threads spinning
# against each other (and against a second pytest process), which made small ops 100x slower.
torch.set_num_threads(1)
