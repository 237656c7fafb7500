"""Shared fixtures. Test modules import helpers as `tests.<module>` (the tests tree is a package)."""

import pytest

import rcr.fused
from tests import tiny_models

FAMILIES = list(tiny_models.FAMILIES)


@pytest.fixture(params=FAMILIES)
def family(request):
    model, processor = tiny_models.FAMILIES[request.param]()
    return request.param, model, processor


@pytest.fixture(scope="session", autouse=True)
def fused_kernel():
    """Build RCR's fused CPU kernels once, up front (about a minute on a fresh machine; cached after that), rather
    than inside whichever test first decodes with rcr; a failed build warns and the torch path is tested."""
    return rcr.fused.available()

