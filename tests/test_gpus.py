"""What a plain run chooses on the GPUs people own (precision, compile, the peak for MFU), with each card's
properties reported to this CPU-only torch by a stand-in (conftest.report_card)."""

import contextlib
import sysconfig

import pytest
import torch
import torch._dynamo  # before the stand-in Triton: importing it imports a Triton it finds
import torch._inductor.exc
import torch.utils._triton
from conftest import ARCH_LISTS, CARDS, TINY_ARGS, report_card
from test_ddp import ENTRY, assert_every_rank_stopped_with_one_line, torchrun

import train_gpt2 as t

GPU_ARGS = [arg for arg in TINY_ARGS if arg not in ("--device", "cpu")]  # the user's command: no --device


class FirstStep(Exception):
    """Raised where the first step would begin, after the start line."""


@pytest.fixture
def gpu(monkeypatch, tmp_path, capsys):
    """run(card, flags): main() on that card through the start line; (lines printed, autocast dtype or None,
    the GradScaler on?). Triton is installed, gcc on the PATH and Python's headers in place, as with pip's CUDA
    build of torch on Linux."""
    monkeypatch.setattr(torch.utils._triton, "has_triton_package", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "Python.h").touch()  # Python's headers, as python3-dev installs them
    paths = sysconfig.get_paths
    monkeypatch.setattr(sysconfig, "get_paths", lambda *args: {**paths(*args), "include": str(tmp_path / "include")})
    seen = {}

    class GPTOnTheCPU(t.GPT):
        def to(self, *args, **kwargs):  # train() moves the model to cuda:0: its weights stay on the CPU
            return super().to("cpu")

        def zero_grad(self, *args, **kwargs):  # train()'s first step begins here
            with seen["autocast"]():
                seen.update(dtype=torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None)
            raise FirstStep

    monkeypatch.setattr(t, "GPT", GPTOnTheCPU)
    paths_agree = t.check_paths_agree  # prepare()'s, after the start line: on the CPU, where the weights are
    monkeypatch.setattr(t, "check_paths_agree", lambda model, device: paths_agree(model, "cpu"))
    autocast_for = t.autocast_for

    def recorded_autocast_for(dtype, device):  # train's autocast for its steps
        seen.update(autocast=autocast_for(dtype, device))
        return seen["autocast"]

    GradScaler = torch.amp.GradScaler

    def recorded_grad_scaler(*args, **kwargs):  # train's
        scaler = GradScaler(*args, **kwargs)
        seen.update(scaler=scaler.is_enabled())
        return scaler

    monkeypatch.setattr(t, "autocast_for", recorded_autocast_for)
    monkeypatch.setattr(torch.amp, "GradScaler", recorded_grad_scaler)

    def run(card, flags=()):
        report_card(card, monkeypatch.setattr)
        with pytest.raises(FirstStep):
            t.main(t.parse_args(GPU_ARGS + ["--log_dir", str(tmp_path / card)] + list(flags)))
        return capsys.readouterr().out.splitlines(), seen["dtype"], seen["scaler"]

    return run


def start(card, detail):
    return f"device cuda:0, {card} ({detail}), 1 process; 1,637,248 parameters; 256 tokens per step"


@pytest.mark.parametrize("card, name, bfloat16, peak", [
    ("h100", "NVIDIA H100 80GB HBM3", True, 989), ("a100", "NVIDIA A100-SXM4-80GB", True, 312),
    ("4090", "NVIDIA GeForce RTX 4090", True, 165), ("v100", "Tesla V100-SXM2-16GB", False, 125),
    ("t4", "Tesla T4", False, 65)])
def test_cards_that_run_triton_compile_and_pick_bfloat16_only_where_they_have_it(gpu, card, name, bfloat16, peak):
    """torch.cuda.is_bf16_supported() is true on all five (it counts emulation): the V100 and T4 took bfloat16,
    which they emulate slowly and Inductor declines to compile."""
    lines, dtype, scaler = gpu(card)
    assert torch.cuda.is_bf16_supported() and torch.cuda.is_bf16_supported(including_emulation=False) == bfloat16
    assert torch._dynamo.device_interface.CudaInterface.is_triton_capable(0)  # torch's own check passes
    dtype_name = "bfloat16" if bfloat16 else "float16"
    assert lines[0].startswith(start(name, f"{dtype_name}, compile on, MFU against {peak} TFLOP/s")), lines
    assert dtype == getattr(torch, dtype_name) and scaler == (not bfloat16)  # float16 needs the loss scaler


def test_h100_a100_4090_under_dtype_float32_are_measured_against_their_tf32_peak(gpu):
    for card, peak in (("h100", 495), ("a100", 156), ("4090", 82.6)):
        lines, dtype, _ = gpu(card, ["--dtype", "float32"])
        assert f"(float32, compile on, MFU against {peak:g} TFLOP/s)" in lines[0] and dtype is None


def test_1080_runs_float16_without_compile_and_says_why(gpu):
    """The GTX 1080 Ti (6.1): torch's Inductor, and so compile, needs 7.0; its first compiled step raised
    GPUTooOldForTriton."""
    lines, dtype, scaler = gpu("1080")
    with pytest.raises(torch._inductor.exc.GPUTooOldForTriton):
        torch._dynamo.device_interface.CudaInterface.raise_if_triton_unavailable(0)  # torch's own check refuses it
    assert lines[0] == ("compile off: torch.compile needs compute capability 7.0 or more, this GPU has 6.1 (on an "
                        "H100 compile trains 1.54x faster: 489k against 317k tokens/s)")
    assert lines[1].startswith(start("NVIDIA GeForce GTX 1080 Ti", "float16, compile off, MFU against 11.3 TFLOP/s"))
    assert dtype == torch.float16 and scaler


@pytest.mark.parametrize("card, flags, message", [
    ("1080", ["--compile"], "--compile cannot run on NVIDIA GeForce GTX 1080 Ti: torch.compile needs compute "
                            "capability 7.0 or more, this GPU has 6.1; use --no-compile"),
    ("v100", ["--dtype", "bfloat16"], "--dtype bfloat16: Tesla V100-SXM2-16GB (compute capability 7.0) has no "
                                      "bfloat16 arithmetic: use --dtype float16"),
    ("t4", ["--dtype", "bfloat16"], "--dtype bfloat16: Tesla T4 (compute capability 7.5) has no bfloat16 arithmetic: "
                                    "use --dtype float16"),
])
def test_what_a_card_cannot_do_is_one_line_before_any_work(monkeypatch, capsys, tmp_path, card, flags, message):
    report_card(card, monkeypatch.setattr)
    monkeypatch.setattr(t.CheckedRun, "read_inputs", None)  # never reached: train() starts with it
    with pytest.raises(SystemExit) as exited:
        t.main(t.parse_args(GPU_ARGS + ["--log_dir", str(tmp_path / "log")] + flags))
    assert exited.value.code == 2 and capsys.readouterr() == ("", f"error: {message}\n")


def test_t4_under_torchrun_every_rank_stops_on_dtype_bfloat16_with_one_line(tmp_path):
    """Each rank finds the card on its own machine: all stop together, rank 0 says it."""
    result = torchrun(2, [ENTRY, "card", "t4"] + GPU_ARGS + ["--dtype", "bfloat16", "--log_dir", str(tmp_path)])
    assert_every_rank_stopped_with_one_line(result, "error: --dtype bfloat16: Tesla T4 (compute capability 7.5) has "
                                                    "no bfloat16 arithmetic: use --dtype float16")
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_compile_on_the_cpu_without_a_cpp_compiler_is_one_line(monkeypatch, capsys, tmp_path):
    """Inductor builds the CPU's kernels with $CXX, else g++ (clang++ on macOS): without it, step 0 ended in a
    91-line traceback (InvalidCxxCompiler), after metrics.jsonl was written."""
    monkeypatch.setenv("CXX", str(tmp_path / "g++"))  # not there
    with pytest.raises(SystemExit) as exited:
        t.main(t.parse_args(TINY_ARGS + ["--compile", "--log_dir", str(tmp_path / "log")]))
    assert exited.value.code == 2 and capsys.readouterr() == ("", f"error: --compile on the CPU builds C++ with "
                                                                  f"{tmp_path / 'g++'}, which is not installed: install "
                                                                  "it (g++), or use --no-compile\n")
    assert not (tmp_path / "log").exists()


def test_machines_whose_cards_pick_other_dtypes_stop_with_one_line(tmp_path):
    """An A100 machine and a T4 machine: --dtype auto picked bfloat16 on one and float16 with the loss scaler on the
    other, and DDP averaged scaled with unscaled gradients (a norm of 47,107 logged; the copies drifted apart)."""
    result = torchrun(2, [ENTRY, "card", "a100,t4"] + GPU_ARGS + ["--log_dir", str(tmp_path)])
    assert_every_rank_stopped_with_one_line(result, "error: --dtype auto picked bfloat16 on rank 0 but float16 on rank 1 "
                                                    "(a card without bfloat16): pass --dtype float16 everywhere")
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_a_machine_without_a_c_compiler_trains_without_compile(gpu, monkeypatch, tmp_path, capsys):
    """Triton builds its launcher with $CC, else gcc, else clang: a slim container may have none."""
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no clang
    lines, _, _ = gpu("h100")
    assert lines[0] == ("compile off: Triton builds with a C compiler and cannot run gcc or clang: install gcc (on "
                        "an H100 compile trains 1.54x faster: 489k against 317k tokens/s)")
    assert "(bfloat16, compile off, MFU against 989 TFLOP/s)" in lines[1]
    monkeypatch.setattr(t.CheckedRun, "read_inputs", None)
    with pytest.raises(SystemExit):
        t.main(t.parse_args(GPU_ARGS + ["--compile", "--log_dir", str(tmp_path / "compile")]))
    assert capsys.readouterr().err == ("error: --compile cannot run on NVIDIA H100 80GB HBM3: Triton builds with a C "
                                       "compiler and cannot run gcc or clang: install gcc; use --no-compile\n")


def test_a_card_without_a_known_peak_gets_mfu_only_from_peak_tflops(gpu):
    lines, _, _ = gpu("a6000")
    assert "(bfloat16, compile on, no MFU: its peak TFLOP/s is unknown, give --peak_tflops)" in lines[0]
    lines, _, _ = gpu("a6000", ["--peak_tflops", "155"])
    assert "(bfloat16, compile on, MFU against 155 TFLOP/s)" in lines[0]
    lines, _, _ = gpu("a100", ["--peak_tflops", "300"])  # it overrides the table
    assert "MFU against 300 TFLOP/s" in lines[0]


@pytest.mark.parametrize("build", ["cu130", "cu126"])
@pytest.mark.parametrize("card", ["v100", "1080", "h100", "4090"])
def test_a_card_the_torch_build_has_no_kernels_for_is_one_line_naming_the_build_that_has(monkeypatch, capsys, tmp_path,
                                                                                        card, build):
    """PyPI's default torch (CUDA 13) starts at 7.5: on a V100 or a 1080 Ti the first CUDA op failed with "no kernel
    image is available for execution on the device". The CUDA 12.6 build has both; the RTX 4090 (8.9) runs sm_86's."""
    report_card(card, monkeypatch.setattr, build=build)
    monkeypatch.setattr(t, "GPT", lambda *args: pytest.fail("started"))  # train() builds the model
    with pytest.raises(BaseException) as stopped:
        t.main(t.parse_args(GPU_ARGS + ["--log_dir", str(tmp_path)]))
    name, major, minor, _ = CARDS[card]
    if card in ("v100", "1080") and build == "cu130":
        assert stopped.value.code == 2 and capsys.readouterr().err == (
            f"error: {name} (compute capability {major}.{minor}) has no kernels in torch {torch.__version__}, built "
            "for sm_75 sm_80 sm_86 sm_90 sm_100 sm_120: pip install torch --index-url "
            "https://download.pytorch.org/whl/cu126\n")
    else:
        assert isinstance(stopped.value, pytest.fail.Exception)  # it got as far as building the model


def test_v100_under_torchrun_with_the_cuda_13_build_stops_every_rank_with_one_line(tmp_path):
    result = torchrun(2, [ENTRY, "card", "v100:cu130"] + GPU_ARGS + ["--log_dir", str(tmp_path)])
    assert_every_rank_stopped_with_one_line(
        result, f"error: Tesla V100-SXM2-16GB (compute capability 7.0) has no kernels in torch {torch.__version__}, "
        f"built for {' '.join(ARCH_LISTS['cu130'])}: pip install torch --index-url https://download.pytorch.org/whl/cu126")
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


@pytest.mark.parametrize("cc, named", [("", "$CC=''"), ("/opt/none/cc", "$CC='/opt/none/cc'")])
def test_a_cc_triton_cannot_run_turns_compile_off(gpu, monkeypatch, cc, named):
    """Triton runs $CC as given, even empty, and looks for gcc only without it: gcc on the PATH does not help."""
    monkeypatch.setenv("CC", cc)
    lines, _, _ = gpu("h100")
    assert lines[0] == (f"compile off: Triton builds with a C compiler and cannot run {named}: install gcc (on an H100 "
                        "compile trains 1.54x faster: 489k against 317k tokens/s)")


def test_a_container_without_pythons_headers_trains_without_compile(gpu, monkeypatch, tmp_path):
    """Triton builds its launcher against Python.h from sysconfig's include folder: a slim image with gcc but no
    python3-dev let compile on, and the first step failed."""
    (tmp_path / "include" / "Python.h").unlink()
    lines, _, _ = gpu("h100")
    assert lines[0] == (f"compile off: Triton builds with Python's headers and {tmp_path / 'include'} has no Python.h: "
                        "install python3-dev (on an H100 compile trains 1.54x faster: 489k against 317k tokens/s)")


@pytest.mark.parametrize("major, minor, arch_list, runs", [
    (7, 0, ["sm_75", "sm_80"], False),  # machine code runs only on its own major, at or above its minor
    (8, 9, ["sm_80", "sm_86"], True), (9, 0, ["sm_90a"], True), (10, 3, ["sm_100f"], True),
    (12, 1, ["sm_90", "compute_120"], True), (8, 6, ["sm_90", "compute_120"], False),  # PTX: at or below it
])
def test_kernels_a_card_runs(major, minor, arch_list, runs):
    with contextlib.nullcontext() if runs else pytest.raises(t.RunError, match="has no kernels in torch"):
        t.check_kernels("a card", major, minor, arch_list)


def test_the_paths_check_passes_an_unedited_model_where_cuda_multiplies_float32_in_tf32(monkeypatch):
    """At precision "high", which machine_choices sets on CUDA, cards of 8.0+ multiply float32 in TF32: inputs
    rounded to 10 bits of mantissa. That alone parted the check's paths by 2e-4 at this shape (1.6e-3 at 124M),
    and would have stopped every unedited run on an A100, H100 or RTX 4090 before step 0."""
    linear = torch.nn.functional.linear

    def tf32(x):  # to the nearest TF32: the low 13 of float32's 23 mantissa bits cleared
        return ((x.contiguous().view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)

    def linear_as_cuda_does(x, weight, bias=None):  # cuBLAS on 8.0+: TF32 unless the precision is "highest"
        if torch.get_float32_matmul_precision() == "highest":
            return linear(x, weight, bias)
        return linear(tf32(x), tf32(weight), bias)

    monkeypatch.setattr(torch.nn.functional, "linear", linear_as_cuda_does)
    torch.manual_seed(0)
    model = t.GPT(t.GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=256))
    previous, set_precision = torch.get_float32_matmul_precision(), torch.set_float32_matmul_precision
    set_precision("high")
    try:
        t.check_paths_agree(model, "cpu")  # it compares in float32 itself
        assert torch.get_float32_matmul_precision() == "high"  # and gives training its TF32 back
        monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda precision: None)  # as it was before
        with pytest.raises(t.RunError, match="differ at position"):
            t.check_paths_agree(model, "cpu")
    finally:
        set_precision(previous)
