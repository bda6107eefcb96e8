import os

import pytest
import torch

# Triton kernels run in the interpreter on machines without a GPU (set before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # generate.cli runs on one thread on CPU; the other tests do not
