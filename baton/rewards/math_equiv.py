"""A math reward on math-verify (the maintained package verl's math_verify scorer uses): the response's answer and
the ground truth parsed to sympy and compared, so "1/2", "0.5", "\\frac{1}{2}" and "\\boxed{50\\%}" are the same."""

from __future__ import annotations

from baton.rewards.registry import register_reward


@register_reward("math_verify", slow=True)
def math_verify_reward(response: str, ground_truth: str, **fields) -> dict:
    """{"score": 1.0 when math-verify finds the response's answer (a \\boxed{}, LaTeX or plain expression) equal to the
    ground truth, else 0.0; "pred": that answer as sympy prints it, or None when none parses}.

    The ground truth is parsed as LaTeX, wrapped in \\boxed{} first unless it has a \\boxed{} or $...$ of its own (as
    verl wraps it), so a bare "\\frac{1}{2}" parses. math-verify's own time limits use SIGALRM, which works in a
    process's main thread only and cannot stop a long C call (sympy's big integers); they are off here, so the
    function runs in any thread. It is registered slow, so it is scored in processes of their own with a limit per
    row: reward.timeout_s_per_row, or where that is unset DEFAULT_TIMEOUT_S_PER_ROW, past which a row is killed and
    scored 0 (see `baton.rewards.scoring_pool`). With its limits off, math-verify logs once that "Timeout is disabled".
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold_text = str(ground_truth)
    if "\\boxed" not in gold_text and "$" not in gold_text:
        gold_text = "\\boxed{" + gold_text + "}"
    gold = parse(gold_text, (LatexExtractionConfig(),), parsing_timeout=None)
    answer = parse(response, (ExprExtractionConfig(), LatexExtractionConfig()), parsing_timeout=None)
    correct = bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=None)
    return {"score": float(correct), "pred": str(answer[0]) if answer else None}
