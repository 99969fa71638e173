"""The ``device`` fixture of the op family tests: fed a (backend, device) param of
:func:`tests.ops.common.kernel_backends` (``indirect=True``), it runs the test with that backend
forced, so a missing kernel fails instead of falling back."""
import pytest

from pyprune import ops


@pytest.fixture
def device(request):
    """The device of the (backend, device) param; the test body runs with that backend forced."""
    backend, device = request.param
    if backend == "cpu":
        request.getfixturevalue("cpu_extension_is_built")
    with ops.use_backend(backend):
        yield device
