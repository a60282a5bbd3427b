"""Step rewards on the sampled tokens: from character offsets in a completion's text to its token positions.

A process reward scores steps of the completion's text (`posttrain.rewards.steps`); the policy is trained on the
tokens it sampled, which are never re-tokenised. Each step's end is therefore found in the sampled ids themselves: the
step ends at the first token k whose decoded prefix, ids[:k + 1] decoded as `completion_texts` decodes (special tokens
skipped), starts with the text up to the step's end character. The last step always ends at the response's last token
(its stop token included), so that the decision to stop is credited with the last step's reward.

Assumption: decoding a prefix of the ids gives a prefix of the whole text, but for a character still incomplete at its
end (a byte-level BPE token holding half of a UTF-8 character decodes to U+FFFD). The prefix test, not a count of
decoded characters, is what makes that case land on the token that completes the character. This holds for
character, byte-level BPE and SentencePiece tokenizers; where it fails for a step, no prefix matches and the step ends
at the last token. The search is a binary search per step (the test is monotone in k under the assumption), so a
step costs O(log R) decodes.
"""

from __future__ import annotations

import torch

from posttrain.core.batch import Batch


def token_ends(tokenizer, ids: list[int], text: str, char_ends: list[int]) -> list[int]:
    """For each step ending at character `char_ends[j]` of `text` (the decoded `ids`), the index in `ids` of the token
    that completes it; the last step ends at the last token. `char_ends` is ascending, `ids` not empty."""
    def covers(k: int, prefix: str) -> bool:
        return tokenizer.decode(ids[: k + 1], skip_special_tokens=True).startswith(prefix)

    ends, low = [], 0
    for c in char_ends:
        lo, hi = low, len(ids) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if covers(mid, text[:c]) else (mid + 1, hi)
        ends.append(lo)
        low = lo
    if ends:
        ends[-1] = len(ids) - 1
    return ends


def step_tensors(tokenizer, batch: Batch, texts: list[str],
                 steps: list[list[tuple[int, float]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, R] step_reward, [B, R] step_end) of a sampled batch: 1.0 in step_end at each step's end token, the step's
    reward there in step_reward, 0 elsewhere. Steps whose ends fall on one token (a "\\n\\n" token ends two lines)
    are one step there, with the lowest of their rewards.

    Args:
        tokenizer: the policy's, which sampled the batch.
        batch: its response tokens are the rows' `mask`ed response ids.
        texts: each row's completion text, as the process reward saw it (`completion_texts`).
        steps: each row's (char_end, reward) per step, char_end ascending (`Judge.score_steps`).
    """
    B, R = batch.mask.shape
    reward, end = torch.zeros(B, R), torch.zeros(B, R)  # [B, R], [B, R]
    for i in range(B):
        ids = batch.response_ids[i][batch.mask[i].bool()].tolist()
        if not ids or not steps[i]:
            continue
        for t, (_, r) in zip(token_ends(tokenizer, ids, texts[i], [c for c, _ in steps[i]]), steps[i]):
            reward[i, t] = min(r, float(reward[i, t])) if end[i, t] else r
            end[i, t] = 1.0
    return reward, end
