"""Every bad input is refused at the boundary with a TypeError or ValueError that names the problem."""

import numpy as np
import pytest

import numbaflash
from numbaflash import _arrays
from numbaflash.kernels.intrinsics import SIMULATOR


def qkv(q_shape=(1, 8, 2, 16), kv_shape=(1, 8, 2, 16), dtype=np.float32):
    rng = np.random.default_rng(0)
    return (rng.standard_normal(q_shape).astype(dtype), rng.standard_normal(kv_shape).astype(dtype),
            rng.standard_normal(kv_shape).astype(dtype))


class FakeDeviceArray:
    """Just enough of __cuda_array_interface__ to reach the checks (no kernel is launched)."""

    def __init__(self, shape, ptr):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f4", "data": (ptr, False), "version": 3,
                                         "strides": None}


@pytest.mark.parametrize("shapes,message", [
    (((1, 8, 16), (1, 8, 2, 16)), "must all be 4-D .* or all 2-D .*got ndim 3, 4, 4"),
    (((1, 8, 2, 16, 1), (1, 8, 2, 16)), "got ndim 5, 4, 4"),
    (((2, 8, 2, 16), (1, 8, 2, 16)), r"batch of q \(2\) and of k, v \(1\) differ"),
    (((1, 8, 2, 16), (1, 8, 2, 32)), r"headdim of q \(16\) and of k, v \(32\) differ"),
    (((1, 8, 3, 16), (1, 8, 2, 16)), r"nheads \(3\) must be a multiple of nheads_kv \(2\)"),
    (((1, 8, 2, 300), (1, 8, 2, 300)), "headdim must be between 1 and 256; got 300"),
    (((1, 8, 2, 0), (1, 8, 2, 0)), "headdim must be between 1 and 256; got 0"),
    (((1, 0, 2, 16), (1, 8, 2, 16)), "empty input: .*seqlen_q=0"),
    (((1, 8, 2, 16), (1, 0, 2, 16)), "empty input: .*seqlen_k=0"),
    (((0, 8, 2, 16), (0, 8, 2, 16)), "empty input: batch=0"),
])
def test_bad_shapes(shapes, message):
    q, k, v = qkv(*shapes)
    with pytest.raises(ValueError, match=message):
        numbaflash.attention(q, k, v)


def test_k_and_v_of_different_seqlen():
    q, k, _ = qkv()
    with pytest.raises(ValueError, match=r"k and v must have the same shape .*\(1, 8, 2, 16\) and \(1, 9, 2, 16\)"):
        numbaflash.attention(q, k, np.zeros((1, 9, 2, 16), np.float32))


def test_mixed_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="must share one dtype; got float32, float16, float32"):
        numbaflash.attention(q, k.astype(np.float16), v)


@pytest.mark.parametrize("dtype", [np.int32, np.complex64, np.float128 if hasattr(np, "float128") else np.int8])
def test_unsupported_dtype(dtype):
    q, k, v = (x.astype(dtype) for x in qkv())
    with pytest.raises(TypeError, match="is not supported; use one of float16, bfloat16, float32, float64"):
        numbaflash.attention(q, k, v)


def test_host_and_device_arrays_mixed():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="mix host .NumPy. and device arrays"):
        numbaflash.attention(q, FakeDeviceArray(k.shape, 1024), v)


def test_arrays_on_different_gpus(monkeypatch):
    monkeypatch.setattr(_arrays, "SIMULATOR", False)  # GPU arrays reach their description (the simulator refuses them)
    monkeypatch.setattr(_arrays, "_device_of", lambda ptr: ptr // 1024)
    q, k, v = (FakeDeviceArray((1, 8, 2, 16), device * 1024) for device in (0, 1, 0))
    with pytest.raises(ValueError, match=r"on different GPUs \(0, 1, 0\)"):
        numbaflash.attention(q, k, v)


def test_numpy_without_the_simulator_is_refused(monkeypatch):
    monkeypatch.setattr(_arrays, "SIMULATOR", False)
    with pytest.raises(TypeError, match="NumPy array, which lives in host memory: pass CuPy arrays or torch CUDA"):
        numbaflash.attention(*qkv())


def test_not_an_array():
    with pytest.raises(TypeError, match=r"q must be a CuPy array, a torch CUDA tensor, a NumPy array \(on the CUDA "
                                        r"simulator\).* got builtins.list"):
        numbaflash.attention([[1.0]], *qkv()[1:])


@pytest.mark.parametrize("scale,error,message", [
    (float("nan"), ValueError, "finite number .*; got nan"),
    (float("inf"), ValueError, "finite number .*; got inf"),
    ("0.1", TypeError, "must be a number or None"),
    (True, TypeError, "must be a number or None"),
])
def test_bad_softmax_scale(scale, error, message):
    with pytest.raises(error, match=message):
        numbaflash.attention(*qkv(), softmax_scale=scale)


@pytest.mark.parametrize("window", [(1,), (1, 2, 3), (1.5, 2), "ab", None, (True, 0)])
def test_malformed_window(window):
    with pytest.raises(ValueError, match="window_size must be a pair of ints"):
        numbaflash.attention(*qkv(), window_size=window)


def test_window_below_minus_one():
    with pytest.raises(ValueError, match=r"entries must be >= 0, or -1 for unbounded; got \(-2, 0\)"):
        numbaflash.attention(*qkv(), window_size=(-2, 0))


@pytest.mark.parametrize("flag", ["causal", "return_lse"])
def test_flags_must_be_booleans(flag):
    with pytest.raises(TypeError, match=f"{flag} must be True or False"):
        numbaflash.attention(*qkv(), **{flag: 1})


def test_plan_made_for_another_call():
    q, k, v = qkv()
    other = numbaflash.plan(*qkv(q_shape=(1, 9, 2, 16)))
    with pytest.raises(ValueError, match="plan was made for"):
        numbaflash.attention(q, k, v, plan=other)


def test_a_plan_must_be_a_plan():
    with pytest.raises(TypeError, match="plan must be None or what numbaflash.plan"):
        numbaflash.attention(*qkv(), plan="fast")
    with pytest.raises(TypeError, match="device must be None"):
        numbaflash.plan(*qkv(), device="H100")


@pytest.mark.parametrize("call", [
    lambda q, k, v: numbaflash.explain(q, k, v, backward="yes"),
    lambda q, k, v: numbaflash.plan(q, k, v, backward=1),
])
def test_backward_must_be_a_boolean(call):
    with pytest.raises(TypeError, match="backward must be True or False"):
        call(*qkv())


def test_explain_takes_return_lse_as_attention_does():
    with pytest.raises(TypeError, match="return_lse must be True or False"):
        numbaflash.explain(*qkv(), return_lse="yes")


def test_a_two_dimensional_backward_takes_two_dimensional_gradients():
    q, k, v = (x[0, :, 0] for x in qkv())
    out, lse = numbaflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"dout must be 2-D in a 2-D \(seqlen, headdim\) call"):
        numbaflash.attention_backward(np.ones(16, np.float32), q, k, v, out, lse)
    with pytest.raises(ValueError, match="lse must be 1-D"):
        numbaflash.attention_backward(np.ones_like(out), q, k, v, out, lse[None])
    with pytest.raises(ValueError, match="window_size must be a pair of ints"):
        numbaflash.attention(q, k, v, window_size=5)
    # The messages give the shapes as the caller passed them, not the kernels' (1, seqlen, 1, headdim) views.
    with pytest.raises(ValueError, match=r"dout must match q: shape \(8, 16\), dtype float32 on q's device; "
                                         r"got shape \(8, 16\), dtype float64"):
        numbaflash.attention_backward(np.ones(out.shape), q, k, v, out, lse)
    with pytest.raises(ValueError, match=r"lse must be attention's log-sum-exp: shape \(8,\), dtype float32 on "
                                         r"q's device; got shape \(8,\), dtype float64"):
        numbaflash.attention_backward(np.ones_like(out), q, k, v, out, lse.astype(np.float64))


@pytest.mark.parametrize("shape", ["2-D", "4-D"])
@pytest.mark.parametrize("bad", [None, 1.0, "list"], ids=["None", "a float", "a list"])
@pytest.mark.parametrize("name", ["dout", "out", "lse"])
def test_backward_gradients_must_be_arrays(shape, bad, name):
    q, k, v = qkv() if shape == "4-D" else (x[0, :, 0] for x in qkv())
    out, lse = numbaflash.attention(q, k, v, return_lse=True)
    given = dict(dout=np.ones_like(out), out=out, lse=lse)
    given[name] = given[name].tolist() if bad == "list" else bad
    with pytest.raises(TypeError, match=f"^{name} must be"):
        numbaflash.attention_backward(given["dout"], q, k, v, given["out"], given["lse"])


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's refusal of GPU arrays")
def test_the_simulator_refuses_gpu_arrays_by_name():
    """A GPU array on the simulator has no memory to read there: TypeError naming it, for q, k, v and for the
    backward's own arrays (an lse of __cuda_array_interface__ reached the driver's pointer query, an ImportError)."""
    q, k, v = qkv()
    fake = [FakeDeviceArray(x.shape, 0x7000_0000 + i * 0x10000) for i, x in enumerate((q, k, v))]
    with pytest.raises(TypeError, match="q is a GPU array, but the CUDA simulator .* runs on NumPy arrays"):
        numbaflash.attention(*fake)
    out, lse = numbaflash.attention(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="lse is a GPU array, but the CUDA simulator"):
        numbaflash.attention_backward(np.ones_like(out), q, k, v, out, FakeDeviceArray(lse.shape, 0x7000_0000))


@pytest.mark.gpu
def test_the_backward_takes_lse_of_qs_library():
    """An lse of another library than q's (here CuPy's beside torch's) is refused, as dout and out are."""
    torch, cupy = pytest.importorskip("torch"), pytest.importorskip("cupy")
    q, k, v = (torch.tensor(x, device="cuda") for x in qkv())
    out, lse = numbaflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="lse must be attention's log-sum-exp: .* on q's device"):
        numbaflash.attention_backward(torch.ones_like(out), q, k, v, out, cupy.asarray(lse))


def test_the_torch_function_takes_torch_tensors():
    pytest.importorskip("torch")
    import numbaflash.torch

    with pytest.raises(TypeError, match="takes torch tensors; q is a numpy.ndarray"):
        numbaflash.torch.attention(*qkv())


def test_a_remembered_layout_still_refuses_what_the_checks_refuse():
    """`call_cache` keeps what `inspect` found for a layout; the options enter its key with their types, so an
    option the checks refuse is refused on a layout they have seen (the plain plan is asked for only: no kernel
    runs), and the kept call holds no operand."""
    import gc
    import weakref

    from numbaflash import call_cache

    from numbaflash import interface

    q, k, v = qkv()
    first, again = (interface.inspect(q, k, v, True, 0.5) for _ in range(2))
    assert again.memo is first.memo and again == first  # the second is the kept one, with its own operands
    call_cache._CALLS.clear()
    assert interface.inspect(q, k, v, True, 0.5) == again
    assert all(entry.q is None and entry.memo is not None for entry in call_cache._CALLS.values())
    for options, error, message in ((dict(causal=1), TypeError, "causal must be True or False"),
                                    (dict(causal=np.True_, softmax_scale=float("nan")), ValueError, "finite"),
                                    (dict(softmax_scale=True), TypeError, "softmax_scale must be a number"),
                                    (dict(window_size=(5,)), ValueError, "window_size must be a pair"),
                                    (dict(window_size=(-2, 0)), ValueError, "entries must be >= 0")):
        with pytest.raises(error, match=message):
            numbaflash.plan(q, k, v, **{**dict(causal=True, softmax_scale=0.5), **options})
    seen = weakref.ref(q)
    del q, first, again
    gc.collect()
    assert seen() is None
