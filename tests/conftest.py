"""Settings every test shares: which lab tree is graded, and no network, display or GPU assumed."""
import os

import torch

os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Without a GPU the Triton kernels are tested in Triton's interpreter, which reads this variable
# when triton is first imported: it must be set here, before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    # Registered here, in the top conftest, since pytest takes options only from initial conftests.
    parser.addoption(
        "--impl",
        choices=("labs", "solutions"),
        default="solutions",
        help="which tree tests/labs grades: your work in labs/ or the reference in solutions/",
    )
