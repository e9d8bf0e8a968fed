"""The README checked against the program: its map of train_gpt2.py, its worked change to the model, every command
it shows and every error line it quotes."""

import dataclasses
import errno
import inspect
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

import train_gpt2 as t
from conftest import ROOT, Seen, report_card, turning
from test_cli import error_line_in_process
from test_ddp import torchrun

README = (ROOT / "README.md").read_text()
SOURCE = (ROOT / "train_gpt2.py").read_text()


def sections():
    """(first line, last line, name) of each banner's section: the recipe's, then the machinery's."""
    lines = SOURCE.splitlines()
    banners = [(number, line.removeprefix("# ------------------------------ ").strip())
               for number, line in enumerate(lines, start=1)
               if line.startswith("# ------------------------------ ") or line.startswith("# ====")]
    ends = [number - 1 for number, _ in banners[1:]] + [len(lines)]
    return [(first, last, name) for (first, name), last in zip(banners, ends, strict=True)]


def test_the_map_gives_each_recipe_section_its_lines_and_the_banner_that_ends_the_recipe():
    rows = re.findall(r"^\| (\d+)-(\d+) \| ([^|]+?) \|", README, re.M)
    banner = next(first for first, _, name in sections() if name.startswith("# ===="))
    recipe = [(first, last, name) for first, last, name in sections() if first < banner]
    expected = [(1, recipe[0][0] - 1, "the opening")] + recipe + [(banner, len(SOURCE.splitlines()), "machinery")]
    assert [(int(first), int(last), name) for first, last, name in rows] == expected, (
        "README.md's map of train_gpt2.py is out of date: its rows should be "
        + "; ".join(f"{first}-{last} {name}" for first, last, name in expected))
    assert banner <= 601, f"the recipe is {banner - 1} lines, more than 600"
    assert sum(line.startswith("# ====") for line in SOURCE.splitlines()) == 1
    machinery_row = re.search(r"^\| \d+-\d+ \| machinery \|(.*)$", README, re.M).group(1)
    for _, _, name in sections():
        if not name.startswith("# ====") and name not in {n for _, _, n in recipe}:
            assert name in machinery_row, f"the map's machinery row does not name the section {name!r}"


def worked_change():
    """The README's rotary embedding: (the function, the line for attention's forward)."""
    part = README.split("## Changing the model", 1)[1]
    block = re.search(r"```python\n(.*?)```", part, re.S).group(1)
    function, line = block.split("# 2.", 1)
    return function.split("\n", 1)[1].strip() + "\n\n\n", line.split("\n", 1)[1].rstrip() + "\n"


def worked_change_attention(namespace):
    """CausalSelfAttention with the README's change made at run time, the file's text untouched: step 1's rotate()
    defined in namespace (train_gpt2's own, where torch.compile looks for it, or a copy); the file's forward run with
    a c_attn whose q and k step 2's line turns, split into heads as forward splits them (a view: the numbers the line
    meets there). Nothing is set on the module, so torch.compile traces it whole, recomputed or not."""
    function, line = worked_change()
    assert len(line.splitlines()) == 1, line
    exec(function + f"def turn(q, k, positions):\n    {line.strip()}\n    return q, k\n", namespace)
    turn, plain = namespace["turn"], t.CausalSelfAttention

    class RotaryAttention(plain):
        def forward(self, x, positions, *args, **kwargs):
            c_attn = turning(self.c_attn, x.size(-1) // self.n_head, lambda q, k: turn(q, k, positions))
            return plain.forward(Seen(self, c_attn=c_attn), x, positions, *args, **kwargs)

    return RotaryAttention


def test_the_worked_change_is_at_most_15_lines_and_changes_the_model(monkeypatch):
    function, line = worked_change()
    assert len((function + line).strip().splitlines()) <= 15
    config = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    torch.manual_seed(0)
    plain = t.GPT(t.GPTConfig(**config))
    monkeypatch.setattr(t, "CausalSelfAttention", worked_change_attention(dict(vars(t))))
    rotary = t.GPT(t.GPTConfig(**config))
    rotary.load_state_dict(plain.state_dict())  # the same weights: the change adds none
    idx = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        same_first = torch.allclose(rotary(idx)[:, 0], plain(idx)[:, 0], atol=1e-6)  # position 0: no turn
        differ_later = not torch.allclose(rotary(idx)[:, 1:], plain(idx)[:, 1:], atol=1e-4)
    assert same_first and differ_later, "the rotation must leave position 0 alone and turn the later ones"


class Share:
    """A pytest plugin: of the tests left after -m's selection, this process runs those at places index, index +
    count, ... and writes to path every selected test's id, then its own share's."""

    def __init__(self, index, count, path):
        self.index, self.count, self.path = index, count, path

    @pytest.hookimpl(trylast=True)  # after -m has deselected
    def pytest_collection_modifyitems(self, config, items):
        share = items[self.index::self.count]
        config.hook.pytest_deselected(items=[item for item in items if item not in share])
        with open(self.path, "w") as f:
            f.write(" ".join(item.nodeid for item in items) + "\n" + " ".join(item.nodeid for item in share) + "\n")
        items[:] = share


@pytest.mark.parametrize("change", ["rotary", "tokenizer"])
def test_the_worked_change_passes_the_model_tests_a_hacker_runs(tmp_path, change):
    """`pytest -m "not recipe" tests/test_model.py`, the README's change made before the tests import the file, or
    another tokenizer in place of GPT-2's (conftest's moved_gpt2: nine tests wrote GPT-2's <|endoftext|> into models
    of its 50,304 rows or fewer). Its tests are shared between 2 processes of one thread, one a core, that together
    run each test exactly once."""
    made = {"rotary": "train_gpt2.CausalSelfAttention = test_readme.worked_change_attention(vars(train_gpt2))\n",
            "tokenizer": ""}[change]  # the tokenizer: --tokenizer moved_gpt2 (conftest), as the tests start
    script = ("import sys, pytest, train_gpt2, test_readme\n" + made +
              "share = test_readme.Share(int(sys.argv[1]), 2, sys.argv[2])\n"
              "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-m', 'not recipe', 'tests/test_model.py', "
              f"'--tokenizer', {'moved_gpt2' if change == 'tokenizer' else 'gpt2'!r}], plugins=[share]))\n")
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    shares = [subprocess.Popen([sys.executable, "-c", script, str(index), str(tmp_path / f"share{index}")], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}) for index in (0, 1)]
    try:
        outputs = [share.communicate(timeout=600) for share in shares]
    finally:
        for share in shares:
            share.kill()
    selected, ran = zip(*((tmp_path / f"share{index}").read_text().split("\n")[:2] for index in (0, 1)), strict=True)
    assert selected[0] and selected[0] == selected[1]
    assert sorted(ran[0].split() + ran[1].split()) == sorted(selected[0].split())  # each test once
    for share, (stdout, stderr), tests in zip(shares, outputs, ran, strict=True):
        assert share.returncode == 0, stdout[-3000:] + stderr[-2000:]
        assert re.search(rf"^{len(tests.split())} passed", stdout, re.M), stdout
        assert "failed" not in stdout and "skipped" not in stdout, stdout


def test_the_readme_names_torchruns_variables_and_the_rank_that_logs_and_saves():
    """What the seeds teach first: RANK, LOCAL_RANK (the GPU), WORLD_SIZE, and rank 0 alone logs and saves; the code
    reads exactly those."""
    import train_gpt2 as t

    part = README.split("## Multi-GPU and multi-node", 1)[1].split("\n## ", 1)[0]
    for said in ("`RANK`, the\nprocess's number in the whole job", "`LOCAL_RANK`, its number on its own\nmachine, "
                 "which picks its GPU", "`WORLD_SIZE`, the processes in all", "Rank 0 alone\nprints, logs and "
                 "writes checkpoints"):
        assert said in part, said
    launch = t.launch_from_env({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert (launch.rank, launch.local_rank, launch.world_size, launch.torchrun) == (5, 1, 8, True)


def test_the_readmes_sliding_window_is_the_one_the_model_tests_run():
    """"Changing the model" shows the window as visible()'s return line; tests/test_model.py runs that line."""
    from test_model import sliding_window

    part = README.split("## Changing the model", 1)[1]
    window = re.findall(r"```python\n(.*?)```", part, re.S)[1].split("\n", 1)[1]
    assert window == inspect.getsource(sliding_window).split("\n", 1)[1]
    returns = [line for line in inspect.getsource(t.visible).splitlines() if line.lstrip().startswith("return ")]
    assert len(returns) == 1, f"visible() has {len(returns)} return lines; the README edits its one"


# ------------------------------ every command it shows, as written (issue 56)

def readme_commands():
    """(README line, world size, arguments) of every train_gpt2.py command the README shows: in its bash blocks, inline
    (a command wrapped over lines joined), and the edited model's (the quick start with the flags "Changing the model"
    gives it)."""
    texts = []  # (line, command text)
    for block in re.finditer(r"```bash\n(.*?)```", README, re.S):
        start, text = None, ""
        for number, line in enumerate(block.group(1).splitlines(), start=README.count("\n", 0, block.start(1)) + 1):
            start, text = start or number, text + " " + line.removesuffix("\\")
            if not line.endswith("\\"):
                texts.append((start, text))
                start, text = None, ""
    prose = re.sub(r"```.*?```", lambda block: "\n" * block.group().count("\n"), README, flags=re.S)
    texts += [(prose.count("\n", 0, span.start()) + 1, span.group(1).replace("\n", " "))
              for span in re.finditer(r"`([^`]+)`", prose)]
    edit = re.search(r"the quick start\s+with `([^`]+)`", README)
    quick_start = next(text for _, text in texts if "train_gpt2.py" in text)
    texts.append((README.count("\n", 0, edit.start(1)) + 1, f"{quick_start} {edit.group(1)}"))
    commands = []
    for line, text in sorted(texts):
        for command in text.split("&&"):
            words = shlex.split(command, comments=True) if "train_gpt2.py" in command else []
            if words[:1] not in (["python3"], ["torchrun"]) or "train_gpt2.py" not in words:
                continue  # another program
            at = words.index("train_gpt2.py")
            launcher = dict(word.removeprefix("--").split("=") for word in words[:at] if "=" in word)
            commands.append((line, int(launcher.get("nproc_per_node", 1)) * int(launcher.get("nnodes", 1)),
                             words[at + 1:]))
    return commands


def test_every_command_the_readme_shows_passes_the_config_checks_as_written(tmp_path, monkeypatch):
    """A README command that fails its own checks is a bug: a 30-step benchmark with 715 warmup steps did; the edited
    model's quick start, 5 steps with 10 to warm up, did (issue 56). Each training command leaves here the checkpoint
    its last step writes (as a stand-in: its flags, which --init_from reads), so the commands that start from one
    find it only if an earlier command writes it."""
    monkeypatch.chdir(tmp_path)
    commands = readme_commands()
    assert len(commands) >= 16, commands
    assert (1, ["--data_dir", "edu_fineweb10B", "--max_steps", "30", "--warmup_steps", "10", "--eval_every", "0",
                "--sample_every", "0", "--ckpt_every", "0"]) in [command[1:] for command in commands]  # the benchmark
    for _, _, args in commands:
        cfg = None if "--help" in args else t.parse_args(args)
        if cfg and not (cfg.generate or cfg.eval_only or cfg.export_hf) and cfg.ckpt_every:
            os.makedirs(cfg.log_dir, exist_ok=True)
            model_config = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(t.GPTConfig)}  # --init_from's
            torch.save({"config": dataclasses.asdict(cfg), "model_config": model_config},
                       os.path.join(cfg.log_dir, f"ckpt_{cfg.max_steps}.pt"))
    failures = []
    for line, world_size, args in commands:
        try:
            t.check_config(t.parse_args(args), world_size)
        except SystemExit as exited:  # --help: printed, exit 0
            failures += [] if exited.code == 0 else [f"README.md line {line}: {shlex.join(args)}: exit {exited.code}"]
        except t.RunError as error:
            failures.append(f"README.md line {line}: {shlex.join(args)}: {error}")
    assert not failures, "\n".join(failures)


# ------------------------------ every error line it quotes, as printed (issue 56)

def test_every_error_line_the_troubleshooting_table_quotes_is_the_line_printed(tmp_path, monkeypatch, capsys):
    """It said "needs 16,384" where a plain run says "needs 512", "--micro_batch_size 32" where 64 divides the step,
    and "(did you mean --max_steps?)" in a format of its own (issue 56). Each row's case runs as a user's would, in
    the table's order; "..." in a quote stands for any text."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "log").mkdir()
    quick_start = readme_commands()[0][2]

    def earlier_run():
        (tmp_path / "log" / "ckpt_50.pt").write_bytes(b"")
        return error_line_in_process(quick_start, capsys)

    def out_of_memory():  # the GPU recipe on an H100 (as reported here), out of memory in its first step
        report_card("h100", monkeypatch.setattr)
        monkeypatch.setattr(t, "train", lambda *args: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA OOM")))
        return error_line_in_process([], capsys)

    def full_disk():  # what the training loop's checkpoint write raises, and main prints after "error: "
        monkeypatch.setattr(torch, "save", lambda *args: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(
            errno.ENOSPC))))
        with pytest.raises(t.RunError) as refused:
            t.save_checkpoint("log/ckpt_2000.pt", {}, keep=2)
        return f"error: {refused.value}"

    cases = [lambda: error_line_in_process(["--micro_batch_size", "96"], capsys),
             lambda: error_line_in_process([], capsys),  # a plain run, on tiny Shakespeare
             earlier_run,
             lambda: error_line_in_process(["--max_setps", "20"], capsys),
             lambda: error_line_in_process(["--resume", "log"], capsys),
             out_of_memory,
             full_disk]
    table = README.index("## Troubleshooting")
    quotes = [(README.count("\n", 0, table + row.start()) + 1, row.group(1))
              for row in re.finditer(r"^\| `([^`]+)` \|", README[table:], re.M)]
    assert len(quotes) == len(cases), quotes
    for (line, quote), case in zip(quotes, cases, strict=True):
        printed = case()
        pattern = ".*".join(re.escape(part) for part in f"error: {quote}".split("..."))
        assert re.fullmatch(pattern, printed), f"README.md line {line} quotes `{quote}`; the program prints: {printed}"


def test_a_mistake_under_torchrun_prints_what_the_readme_says():
    """README, "Multi-GPU and multi-node": rank 0's line, then about 40 lines of torchrun's (each quoted there), and
    torchrun's exit status 1; the README promised one line and exit 2 (issue 56)."""
    result = torchrun(2, ["train_gpt2.py", "--device", "cpu", "--max_stepz", "3"])  # OMP_NUM_THREADS set: no notice
    said = "error: unrecognized arguments: --max_stepz 3: did you mean --max_steps? (see --help)"
    lines = result.stderr.splitlines()
    assert (result.returncode, result.stdout, lines[:1]) == (1, "", [said]), result.stderr
    assert 30 <= len(lines) - 1 <= 50, result.stderr
    paragraph = next(part for part in README.split("\n\n") if "ChildFailedError" in part).replace("\n", " ")
    assert "about 40 after" in paragraph and "torchrun exits 1" in paragraph
    quoted = [text for text in re.findall(r"`([^`]+)`", paragraph) if text not in ("error: ...", "OMP_NUM_THREADS")]
    assert quoted == ["ChildFailedError", "train_gpt2.py FAILED", "exitcode", "2"]
    assert all(text in result.stderr for text in quoted) and "exitcode  : 2" in result.stderr.split("Root Cause")[1]


def test_the_machinery_reads_in_the_order_a_run_calls_it_and_the_recipe_names_none_of_it():
    """After the banner, main() first, then each definition below a definition that uses it (issue 57): the
    exceptions are RESUME_AUTO (a default argument) and parse_args (called by the __main__ block). Nothing above the
    banner names anything after it (issue 60): the machinery hardens the recipe by what main() hands train()."""
    import ast

    tree, banner = ast.parse(SOURCE), next(i for i, line in enumerate(SOURCE.splitlines(), 1) if line.startswith("# ===="))
    defs = [(node.lineno, node.name if hasattr(node, "name") else node.targets[0].id, node) for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) or isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Name)]
    uses = {name: {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            | {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)} for _, name, node in defs}
    after = [(line, name, node) for line, name, node in defs if line > banner]
    assert after[0][1] == "RESUME_AUTO" and [name for _, name, node in after if isinstance(node, ast.FunctionDef)][0] == "main"
    above_their_users = [name for line, name, node in after if not name.endswith("Error") and name != "main"
                         and not any(name in uses[user] for other, user, _ in defs if other < line)]
    assert above_their_users == ["RESUME_AUTO", "parse_args"]
    recipe = [node for line, _, node in defs if line < banner]
    named = sorted({name for _, name, _ in after} & {n.id for node in recipe for n in ast.walk(node)
                                                      if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)})
    assert named == [], f"the recipe names {named}, defined after the banner"


def curriculum_line() -> str:
    """The README's sequence-length curriculum: the one line it adds to train()'s loop."""
    part = README.split("sequence-length curriculum", 1)[1]
    block = re.search(r"```python\n(.*?)```", part, re.S).group(1)
    return block.strip().splitlines()[-1].strip()


def test_the_readmes_curriculum_stopped_and_resumed_reads_and_trains_as_the_uninterrupted_run(tmp_path,
                                                                                               monkeypatch, one_thread):
    """The README's line run where it says, at the loop's first line (the hardened Run's hooks: as the loader is made,
    for the first step, and at each step's end, for the next), stopped inside the curriculum, then resumed: the tokens
    read in order and the losses bitwise the uninterrupted run's. It counted windows: a resume after 16-token windows
    read 32-token ones, skipping tokens (losses up to 0.38 apart)."""
    from test_checkpoint import assert_read_in_order, counting_shards, logged, record_batches

    line = curriculum_line()
    assert line.startswith("train_loader.seq_len = ") and len(line) < 100, line

    class Curriculum(t.CheckedRun):
        def make_loader(self, *args):
            loader = super().make_loader(*args)
            exec(line, {"train_loader": loader, "step": self.start_step, "cfg": self.cfg})
            return loader

        def stop_requested(self, steps_done):
            exec(line, {"train_loader": self.loader, "step": steps_done, "cfg": self.cfg})
            return super().stop_requested(steps_done)

    monkeypatch.setattr(t, "CheckedRun", Curriculum)
    args = counting_shards(tmp_path / "data") + ["--max_steps", "6", "--warmup_steps", "3"]
    t.main(t.parse_args(args + ["--log_dir", str(tmp_path / "straight")]))
    batches = record_batches(monkeypatch)
    t.main(t.parse_args(args + ["--log_dir", str(tmp_path / "resumed"), "--stop_after_steps", "2"]))
    t.main(t.parse_args(args + ["--log_dir", str(tmp_path / "resumed"), "--resume", "auto"]))
    assert [x.shape[1] for x in batches] == [16] * 6 + [32] * 6  # 2 micro-steps a step: 3 steps of 16, 3 of 32
    assert_read_in_order(batches)
    assert logged(tmp_path / "resumed") == logged(tmp_path / "straight")
