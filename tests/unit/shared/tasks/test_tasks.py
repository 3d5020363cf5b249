"""Task registry, prompts and rewards on hand cases; the char tokenizer as a real HF tokenizer."""

import json

import pytest
from transformers import AutoTokenizer

from shared.tasks import get_task, list_tasks, parse_number
from shared.tokenizer import BOS, EOS, PAD, build_tokenizer, save_tokenizer


def test_registry():
    assert list_tasks() == ["addition", "countdown", "gsm8k", "sorting"]
    assert get_task("addition", max_digits=5).max_digits == 5
    with pytest.raises(KeyError, match="unknown task 'nope'"):
        get_task("nope")


@pytest.mark.parametrize("name", ["addition", "sorting", "countdown"])
def test_prompts_deterministic_and_demonstrations_earn_full_reward(name):
    task = get_task(name)
    prompts = task.make_prompts(30, seed=5)
    assert prompts == task.make_prompts(30, seed=5) != task.make_prompts(30, seed=6)
    for prompt, answer in prompts:
        demo = task.demonstration(prompt, answer)
        assert task.reward(demo, answer) == (1.0, True)
        assert len(demo) + 1 <= task.max_new_tokens  # + EOS fits the generation budget


@pytest.mark.parametrize("name", ["addition", "sorting", "countdown"])
def test_generated_answers_pass_the_submission_check(name):
    task = get_task(name)
    for _, answer in task.make_prompts(50, seed=1):
        task.check_answer(answer)


@pytest.mark.parametrize(
    ("name", "good", "bad"),
    [
        ("addition", ["579", "0"], [None, "", "five", "5 79", "-3", "٣"]),
        ("sorting", ["3 7 19", "5"], [None, "", "3,7", "3  7", " 3 7", "a b"]),
        ("countdown", ["3 7 25 -> 46", " 1 2 -> 3 "], [None, "46", "", " -> 46", "3 7 25 => 46", "3 7 -> x"]),
        ("gsm8k", ["72", "so #### 1,000", "$3.50"], [None, "", "none", "#### n/a"]),
    ],
)
def test_answers_a_task_cannot_score_are_refused(name, good, bad):
    task = get_task(name)
    for answer in good:
        task.check_answer(answer)
        task.reward("anything", answer)  # what the check accepts, the reward can score
    for answer in bad:
        with pytest.raises(ValueError):
            task.check_answer(answer)


def test_addition_scratchpad_format_and_length():
    assert get_task("addition").scratchpad == "sum"  # type: ignore[attr-defined]  # the default
    task = get_task("addition", scratchpad="column")
    assert task.demonstration("add 345+678\n", "1023") == "5+8+0=13\n4+7+1=12\n3+6+1=10\n=1023"
    lengths = [len(task.demonstration(p, a)) for p, a in task.make_prompts(200, seed=0)]
    assert (
        30 <= min(lengths) and max(lengths) <= 70
    )  # 3-6 digits: long enough for a KV budget of 16-32 to bite
    assert len({get_task("addition", scratchpad=pad).format for pad in ("column", "running", "sum")}) == 3


def test_addition_prompts_cycle_through_the_digit_counts():
    task = get_task("addition", min_digits=3, max_digits=6)
    digits = [len(p.split("+")[1]) - 1 for p, _ in task.make_prompts(12, seed=3)]
    assert sorted(digits[:4]) == [3, 4, 5, 6] and digits[4:8] == digits[:4] == digits[8:]
    firsts = {len(task.make_prompts(1, seed=s)[0][0].split("+")[1]) - 1 for s in range(40)}
    assert firsts == {3, 4, 5, 6}  # one prompt alone still gets any length


def test_addition_levels_are_its_operand_lengths_and_other_tasks_are_one_level():
    levels = get_task("addition", min_digits=3, max_digits=6, scratchpad="running").levels()
    assert [level.make_prompts(1, 0)[0][0].index("+") - len("add ") for level in levels] == [3, 4, 5, 6]
    for digits, level in enumerate(levels, start=3):
        prompts = level.make_prompts(8, 1)
        assert all(len(p.split("+")[1].strip()) == digits for p, _ in prompts)
        assert level.scratchpad == "running"  # type: ignore[attr-defined]
        assert all(level.reward(level.demonstration(p, a), a)[1] for p, a in prompts)
    sorting = get_task("sorting")
    assert sorting.levels() == [sorting]


def test_running_scratchpad_restates_what_is_left():
    task = get_task("addition", min_digits=3, max_digits=5, scratchpad="running")
    assert (
        task.demonstration("add 345+678\n", "1023") == "345+678:5+8+0=13\n34+67:4+7+1=12\n3+6:3+6+1=10\n=1023"
    )
    for prompt, answer in task.make_prompts(100, seed=1):
        demo = task.demonstration(prompt, answer)
        assert task.reward(demo, answer) == (1.0, True)
        assert len(demo) + 1 <= task.max_new_tokens
    assert (
        max(len(task.demonstration(p, a)) for p, a in task.make_prompts(200, seed=0)) + 1
        == task.max_new_tokens
    )
    with pytest.raises(ValueError, match="scratchpad"):
        get_task("addition", scratchpad="diagonal")


def test_sum_scratchpad_carries_the_sum_so_far_to_the_last_line():
    task = get_task("addition", min_digits=3, max_digits=6, scratchpad="sum")
    assert task.demonstration("add 345+678\n", "1023") == "5+8+0=13:3\n4+7+1=12:23\n3+6+1=10:023\n=1023"
    for prompt, answer in task.make_prompts(200, seed=2):
        demo = task.demonstration(prompt, answer)
        *lines, final = demo.split("\n")
        assert task.reward(demo, answer) == (1.0, True) and len(demo) + 1 <= task.max_new_tokens
        # line k holds k digits of the sum; the last line and its carry give the whole answer
        assert [len(line.split(":")[1]) for line in lines] == list(range(1, len(lines) + 1))
        last = lines[-1]
        carry = int(last.split("=")[1][0])
        assert final == "=" + ("1" if carry else "") + last.split(":")[1] == f"={answer}"
    longest = task.demonstration("add 999999+999999\n", "1999998")
    assert len(longest) + 1 == task.max_new_tokens == (6 * 6 + 23 * 6 + 6) // 2
    assert [level.scratchpad for level in task.levels()] == ["sum"] * 4  # type: ignore[attr-defined]


def test_addition_rewards():
    task = get_task("addition")
    pad = "5+8+0=13\n4+7+1=12\n3+6+1=10\n"
    assert task.reward(pad + "=1023", "1023") == (1.0, True)
    assert task.reward("=1023\n", "1023") == (1.0, True)  # scratchpad is not graded
    assert task.reward(pad + "=1024", "1023") == (0.5 * 3 / 4, False)  # 3 of 4 digits right
    assert task.reward(pad + "=10230", "1023") == (0.0, False)  # right-aligned: no digit matches
    assert task.reward(pad + "=1x23", "1023") == (0.0, False)  # garbled
    assert task.reward(pad[:-5], "1023") == (0.0, False)  # truncated before the answer
    assert task.reward("", "1023") == (0.0, False)


def test_sorting_rewards():
    task = get_task("sorting")
    assert task.demonstration("sort 42 7 19\n", "7 19 42") == "7 19 42"
    assert task.reward("7 19 42", "7 19 42") == (1.0, True)
    assert task.reward("7 42 19", "7 19 42") == (0.5 / 3, False)
    assert task.reward("7 19", "7 19 42") == (0.5 * 2 / 3, False)  # truncated
    assert task.reward("7 19 4a", "7 19 42") == (0.0, False)


def test_countdown_rewards():
    task = get_task("countdown")
    answer = "3 7 25 -> 46"
    assert task.reward("7*3=21\n25+21=46", answer) == (1.0, True)
    assert task.reward("25+21=46\n7*3=21", answer) == (0.0, False)  # 21 not yet available
    assert task.reward("7*3=21\n25+21=45", answer) == (0.0, False)  # wrong arithmetic
    assert task.reward("25+21=46", "21 25 -> 46") == (1.0, True)
    assert task.reward("7+3=10\n10+25=35", answer) == (0.0, False)  # wrong target
    assert task.reward("7*3=21", answer) == (0.0, False)  # truncated: 25 unused
    assert task.reward("3-7=-4", answer) == (0.0, False)  # negative: unparsable
    assert task.reward("7*7=49", "7 7 -> 49") == (1.0, True)
    assert task.reward("7*7=49", "7 1 -> 49") == (0.0, False)  # uses 7 twice
    with pytest.raises(ValueError):
        task.reward("1+1=2", "garbage")


def test_numeric_answers():
    assert parse_number("so 3 + 4 = 7 apples\n#### 1,234") == 1234
    assert parse_number("She pays $18.50 in total.") == parse_number("18.5")
    assert parse_number("no digits") is None
    task = get_task("gsm8k")
    assert task.reward("4 + 4 = 8. #### 8", "8") == (1.0, True)
    assert task.reward("The answer is 8.0", "8") == (1.0, True)
    assert task.reward("#### 9", "8") == (0.0, False)
    assert task.reward("I think 8 ... then 9", "8") == (0.0, False)  # the last number counts
    assert task.reward("", "8") == (0.0, False)
    with pytest.raises(ValueError, match="JSONL"):
        task.make_prompts(1, seed=0)


def test_numeric_task_from_jsonl(tmp_path):
    rows = [{"question": "2+2?", "answer": "Add.\n#### 4"}, {"question": "Half of 7?", "answer": "3.50"}]
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    task = get_task("gsm8k", source=path)
    prompts = task.make_prompts(5, seed=1)
    assert sorted(set(prompts)) == [
        ("Question: 2+2?\nAnswer:", "4"),
        ("Question: Half of 7?\nAnswer:", "3.5"),
    ]
    assert len(prompts) == 5
    path.write_text('{"question": "no answer"}\n')
    with pytest.raises(ValueError, match=r"q.jsonl:1"):
        get_task("gsm8k", source=path).make_prompts(1, seed=0)


def test_tokenizer_round_trip_and_autotokenizer(tmp_path):
    tok = build_tokenizer()
    text = get_task("addition").demonstration("add 345+678\n", "1023")
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1  # one token per character
    assert tok.decode(ids, skip_special_tokens=True) == text
    save_tokenizer(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token) == (BOS, EOS, PAD)
    assert loaded(text)["input_ids"] == ids
    assert loaded.decode(ids + [loaded.eos_token_id], skip_special_tokens=True) == text
    assert loaded.decode(loaded("Q: 2 + 2?\n")["input_ids"], skip_special_tokens=True) == "Q: 2 + 2?\n"
    assert loaded("é")["input_ids"][1] == loaded.unk_token_id
