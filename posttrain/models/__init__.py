"""Models: loading every role (policy, reference, critic, reward model) from a Hugging Face directory, and scoring.

`loading.load` is the one loader; `scoring` turns a model and a padded batch into per-token log-probabilities (policy,
old policy, reference) or values (critic); `embedded` builds the tiny model and tokenizer of the embedded default.
"""
