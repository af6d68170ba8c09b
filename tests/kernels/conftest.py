import pytest

from tests.kernels.targets import kernel_targets


@pytest.fixture(scope="module", params=kernel_targets())
def target(request) -> str:
    """The -march a kernel test builds its kernel for: each of kernel_targets() in turn."""
    return request.param
