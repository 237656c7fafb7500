"""Shared fixtures. Test modules import helpers as `tests.<module>` (the tests tree is a package)."""

import pytest

from tests import tiny_models

FAMILIES = list(tiny_models.FAMILIES)


@pytest.fixture(params=FAMILIES)
def family(request):
    model, processor = tiny_models.FAMILIES[request.param]()
    return request.param, model, processor
