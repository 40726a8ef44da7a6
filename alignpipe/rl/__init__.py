"""RL math on rewards, as small pure functions with tensor shapes in their docstrings (verl's
``core_algos`` style): GRPO advantages (``advantages``), the reference KL term (``kl``), reward
shaping and scaling (``shaping``). What computes a reward lives in ``alignpipe.rewards``."""
