import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# No test may reach the Hub; set before transformers/huggingface_hub read it at import. Subprocesses inherit it.
os.environ["HF_HUB_OFFLINE"] = "1"

import rcr  # noqa: E402
import tiny_models  # noqa: E402

# Every method test runs over this list: a method added to the registry is covered automatically.
ALL_METHODS = list(rcr.METHODS)
FAMILIES = list(tiny_models.FAMILIES)


@pytest.fixture(params=FAMILIES)
def family(request):
    model, processor = tiny_models.FAMILIES[request.param]()
    return request.param, model, processor
