"""The ``device`` fixture of the op family tests: fed an (implementation, device) param of
:func:`tests.ops.common.kernel_implementations` (``indirect=True``), it runs the test with that
implementation forced, so a missing kernel fails instead of falling back."""
import pytest

from pyprune import ops


@pytest.fixture
def device(request):
    """The device of the (implementation, device) param; the test body runs with it forced."""
    implementation, device = request.param
    if implementation == "cpu":
        request.getfixturevalue("cpu_extension_is_built")
    with ops.use_implementation(implementation):
        yield device
