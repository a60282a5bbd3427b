"""posttrain: post-training methods as gradient-coefficient plugins over one shared engine.

The DeepSeekMath paper (arXiv:2402.03300, §5.2.1) writes the gradient of SFT, RFT, DPO, PPO and GRPO in one form,
E[(1/|o|) Σ_t GC(q, o, t) ∇θ log πθ(o_t | q, o_<t)]; methods differ in data source, reward and GC only.
"""

__version__ = "0.1.0"
