"""Post-training a HF model directory end to end: a chat-format jsonl rendered with the model's own
chat template and tokenizer, a user reward that reads the rows' extra columns, the trainer and the
engine loading the directory's weights (the sync check holds from step 0)."""

import json
import textwrap

import pytest
from hf_fixtures import model_dir

from e2e_util import EXAMPLE, hpcrl

pytestmark = pytest.mark.e2e

REWARD = textwrap.dedent('''
    def score(prompt, completion, answer, extra=None):
        """Half the row's `bonus` column, plus half when the answer appears: only `extra` can say
        what the bonus is, so the logged mean proves it arrived."""
        assert prompt.startswith("<|im_start|>system") and "<|im_start|>user" in prompt, prompt  # rendered
        return 0.5 * float(extra["bonus"]) + 0.5 * float(answer in completion)
''')


@pytest.mark.timeout(400)
def test_chat_jsonl_with_the_models_tokenizer_and_a_reward_reading_extra(tmp_path):
    model = model_dir(tmp_path / "model", "qwen3_moe", seed=4)
    rows = [{"prompt": [{"role": "system", "content": "Repeat the letter."},
                        {"role": "user", "content": f"Repeat the letter: {c}"}],
             "reward_model": {"ground_truth": c * 4}, "bonus": 1.0, "data_source": "letters"}
            for c in "abcdefgh"]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_reward.py").write_text(REWARD)
    run_dir = tmp_path / "run"
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), "--set", f"model.path={model}",
                   "--set", f"data.path={data}", "--set", "data.answer_key=reward_model.ground_truth",
                   "--set", "data.chat_template_kwargs={enable_thinking: false}",
                   "--set", "data.num_prompts_per_step=4", "--set", "algorithm.group_size=2",
                   "--set", "algorithm.num_steps=3", "--set", "rollout.max_new_tokens=6",
                   "--set", "reward.fn=my_reward:score", "--set", "logging.progress=false",
                   timeout_s=360, env_extra={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3
    for r in records:
        assert r["sync/logprob_max_abs_diff"] < 1e-4, r
        assert r["reward/errors"] == 0, r
        assert r["reward/mean"] >= 0.5, r  # every row's bonus counted
        assert r["rollout/tokens"] > 0
    assert "tokenized by" in out.stdout and str(model) in out.stdout, out.stdout[-2000:]
