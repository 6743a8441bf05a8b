"""kernels/common/pdl.py: when the forward's kernels launch with programmatic dependent launch (never off CUDA or in the
interpreter; VERIFYBENCH_PDL and forced() on a capable GPU), and the wrappers' `pdl` argument."""
import pytest
import torch

from verifybench.kernels.common import pdl


def test_off_on_cpu_whatever_is_asked(monkeypatch):
    monkeypatch.setenv(pdl.ENV, "1")
    assert not pdl.capable("cpu") and not pdl.enabled("cpu")
    assert pdl.resolve(None, "cpu") is False and pdl.resolve(True, "cpu") is False
    with pdl.forced(True):
        assert not pdl.enabled("cpu")


def test_off_in_the_interpreter_even_on_cuda_tensors(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.capable("cuda") and not pdl.enabled("cuda")


def test_resolve_takes_none_or_a_bool_only():
    assert pdl.resolve(False, "cpu") is False
    for bad in (1, "on", 0.0):
        with pytest.raises(ValueError, match="pdl must be None, True or False"):
            pdl.resolve(bad, "cpu")


def test_a_bad_environment_value_is_an_error(monkeypatch):
    monkeypatch.setenv(pdl.ENV, "yes")
    with pytest.raises(ValueError, match="VERIFYBENCH_PDL must be 0 or 1"):
        pdl.enabled("cpu")
    with pdl.forced(False):  # forced() wins over the environment, so it is not read
        assert not pdl.enabled("cpu")


def test_launch_kwargs():
    assert pdl.launch_kwargs(True) == {"launch_pdl": True} and pdl.launch_kwargs(False) == {}


@pytest.mark.gpu
def test_environment_and_forced_on_a_capable_gpu(monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90")
    monkeypatch.setenv(pdl.ENV, "1")
    assert pdl.enabled("cuda")
    monkeypatch.setenv(pdl.ENV, "0")
    assert not pdl.enabled("cuda") and pdl.resolve(True, "cuda")  # an explicit True still runs it
    with pdl.forced(True):
        assert pdl.enabled("cuda")
        with pdl.forced(False):  # nested: the innermost wins
            assert not pdl.enabled("cuda")
        assert pdl.enabled("cuda")
    assert not pdl.enabled("cuda")


def test_forced_blocks_nest_and_unwind_on_errors():
    with pytest.raises(RuntimeError):
        with pdl.forced(True):
            with pdl.forced(False):
                assert pdl._FORCED == [True, False]
                raise RuntimeError("inside")
    assert pdl._FORCED == []
