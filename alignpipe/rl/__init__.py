"""RL math on rewards and log-probs, as small pure functions with tensor shapes in their
docstrings (verl's ``core_algos`` style): GRPO advantages (``advantages``), its clipped
policy-gradient loss (``policy_gradient``) and reference KL term (``kl``), the DPO and
Bradley-Terry preference losses and pair metrics (``preference``), reward shaping and scaling
(``shaping``). What computes a reward lives in ``alignpipe.rewards``."""
