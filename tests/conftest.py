import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import rcr  # noqa: E402
import tiny_models  # noqa: E402

# Every method test runs over this list: a method added to the registry is covered automatically.
ALL_METHODS = list(rcr.METHODS)
FAMILIES = list(tiny_models.FAMILIES)


@pytest.fixture(params=FAMILIES)
def family(request):
    model, processor = tiny_models.FAMILIES[request.param]()
    return request.param, model, processor
