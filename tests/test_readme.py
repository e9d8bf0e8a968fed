"""The README's map of train_gpt2.py and its worked change to the model, checked against the file."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import torch

from conftest import ROOT

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
    assert banner <= 621, f"the recipe is {banner - 1} lines, more than 620"
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


def edited_copy(folder):
    """train_gpt2.py with the README's change applied, as a user would paste it."""
    function, line = worked_change()
    source = SOURCE.replace("class CausalSelfAttention(nn.Module):", function + "class CausalSelfAttention(nn.Module):")
    heads = next(text for text in source.splitlines(keepends=True) if text.strip().endswith("for t in (q, k, v))"))
    assert source.count(heads) == 1 and len(line.splitlines()) == 1
    source = source.replace(heads, heads + line)
    (folder / "train_gpt2.py").write_text(source)
    return folder / "train_gpt2.py"


def test_the_worked_change_is_at_most_15_lines_and_changes_the_model(tmp_path):
    function, line = worked_change()
    assert len((function + line).strip().splitlines()) <= 15
    spec = importlib.util.spec_from_file_location("rotary_train_gpt2", edited_copy(tmp_path))
    edited = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(edited)
    import train_gpt2

    config = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    torch.manual_seed(0)
    plain = train_gpt2.GPT(train_gpt2.GPTConfig(**config))
    rotary = edited.GPT(edited.GPTConfig(**config))
    rotary.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        same_first = torch.allclose(rotary(idx)[0][:, 0], plain(idx)[0][:, 0], atol=1e-6)  # position 0: no turn
        differ_later = not torch.allclose(rotary(idx)[0][:, 1:], plain(idx)[0][:, 1:], atol=1e-4)
    assert same_first and differ_later, "the rotation must leave position 0 alone and turn the later ones"


def test_the_worked_change_passes_the_model_tests_a_hacker_runs(tmp_path):
    """`pytest -m "not recipe" tests/test_model.py` on a copy of the project with the README's change."""
    (tmp_path / "tests").mkdir()
    for name in ("conftest.py", "test_model.py"):
        shutil.copy(ROOT / "tests" / name, tmp_path / "tests" / name)
    shutil.copy(ROOT / "input.txt", tmp_path / "input.txt")
    edited_copy(tmp_path)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not recipe",
                             "tests/test_model.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


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
    """"Changing the model" shows the window as one line in visible(); tests/test_model.py applies that line."""
    from test_model import SLIDING_WINDOW, VISIBLE

    part = README.split("## Changing the model", 1)[1]
    window = re.findall(r"```python\n(.*?)```", part, re.S)[1].split("\n", 1)[1]
    assert window == SLIDING_WINDOW and VISIBLE in SOURCE
