"""
The one configuration of a model: its Llama-style transformer and its NOSA selection, with presets
(Config.from_preset) or read from a Hugging Face Llama config.json (Config.from_hf).
The symbols are the paper's (nosa.py's docstring and docs/METHOD.md §2 say what each means); every
field is checked when a Config is made, so a bad config.json or --set fails in one line, here.
"""

import math
from dataclasses import asdict, dataclass, fields, replace

MODES = ("full", "infllmv2", "dma", "nosa", "nosa-hh")


@dataclass(frozen=True)
class Config:
    # Llama-style transformer
    vocab_size: int = 4096
    n_layer: int = 4
    dim: int = 256
    H_q: int = 8  # query heads
    H_kv: int = 2  # KV heads
    head_dim: int = 32  # d
    hidden_dim: int = 704  # SwiGLU width
    max_seq_len: int = 4096  # longest sequence (prompt + generation) the model accepts
    rope_theta: float = 10000.0
    rope_scaling: dict = (
        None  # None, or Llama's long-context RoPE: {"rope_type": "linear" | "llama3", ...}
    )
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # NOSA
    attn: str = "nosa"  # one of MODES
    B: int = 16
    l_c: int = 8
    s_c: int = 4
    n_sink: int = 1
    n_win: int = 4
    k: int = 16
    k_q: int = 4
    hh_recency: float = 0.0  # nosa-hh: E = log h + hh_recency · (block index); 0: E = h

    def __post_init__(self):
        def check(ok, msg):
            if not ok:
                raise ValueError(f"invalid NOSA config: {msg}")

        kinds = {
            int: (int, "an integer"),
            float: ((int, float), "a number"),
            bool: (bool, "true or false"),
            str: (str, "a string"),
        }
        for f in fields(self):  # a config.json may hold 16.5 or "16": say so here, not in a kernel
            want, say = kinds.get(f.type, (object, ""))
            v = getattr(self, f.name)
            check(
                isinstance(v, want) and (f.type is bool or not isinstance(v, bool)),
                f"{f.name}={v!r} must be {say}",
            )
        for name in ("rope_theta", "norm_eps"):  # a config.json may hold NaN or Infinity
            v = getattr(self, name)
            check(math.isfinite(v) and v > 0, f"{name}={v!r} must be a positive, finite number")
        scaling = self.rope_scaling or {}
        check(
            isinstance(scaling, dict)
            and all(
                isinstance(v, (int, float))
                and not isinstance(v, bool)
                and math.isfinite(v)
                and v > 0
                for k, v in scaling.items()
                if k != "rope_type"
            ),
            f"rope_scaling={self.rope_scaling!r}: its numbers must be positive and finite",
        )
        check(self.attn in MODES, f"attn={self.attn!r}; choose one of {MODES}")
        sizes = (
            "n_layer",
            "dim",
            "H_q",
            "H_kv",
            "head_dim",
            "hidden_dim",
            "vocab_size",
            "B",
            "l_c",
            "s_c",
            "k",
        )
        bad = [f"{n}={getattr(self, n)}" for n in sizes if getattr(self, n) <= 0]
        check(not bad, f"{', '.join(bad)}: sizes must be positive")
        check(self.H_q % self.H_kv == 0, f"H_q={self.H_q} must be a multiple of H_kv={self.H_kv}")
        check(self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even for RoPE")
        check(0 < self.s_c <= self.l_c, f"need 0 < s_c <= l_c (got s_c={self.s_c}, l_c={self.l_c})")
        check(self.B % self.s_c == 0, f"B={self.B} must be a multiple of s_c={self.s_c}")
        check(self.n_sink >= 0 and self.n_win >= 0, "n_sink and n_win must be >= 0")
        check(
            self.l_c - self.s_c <= self.n_win * self.B,
            f"sub-blocks reach l_c - s_c = {self.l_c - self.s_c} tokens past a block; the window "
            f"(n_win*B = {self.n_win * self.B}) must cover that so block scores are final when chosen",
        )
        check(
            1 <= self.k_q <= self.k,
            f"need 1 <= k_q <= k: the query's own block is one of the k_q "
            f"query-aware blocks (got k_q={self.k_q}, k={self.k})",
        )
        check(
            self.k_e >= self.n_sink + self.n_win,
            f"k_e = k - k_q = {self.k_e} must hold the n_sink + n_win = {self.n_sink + self.n_win} sink and "
            f"window blocks; raise k or lower k_q, n_win, n_sink",
        )
        check(self.max_seq_len >= self.B, "max_seq_len must hold at least one block")
        check(
            self.attn != "nosa-hh" or self.n_win >= 1,
            "nosa-hh scores a block by the attention it got in the window: need n_win >= 1",
        )
        check(
            math.isfinite(self.hh_recency) and self.hh_recency >= 0,
            f"hh_recency={self.hh_recency!r} must be a finite number >= 0",
        )
        check(
            self.hh_recency == 0 or self.attn == "nosa-hh",
            f"hh_recency={self.hh_recency} blends recency into nosa-hh's E: set attn=nosa-hh",
        )
        check(
            self.rope_scaling is None or self.rope_scaling.get("rope_type") in ("linear", "llama3"),
            f"rope_scaling={self.rope_scaling!r}: None, or a linear or llama3 scaling",
        )

    @property
    def k_e(self):  # query-agnostic budget: sinks, window before the own block, core
        return self.k - self.k_q

    @property
    def sparse(self):  # selects blocks (every mode but full attention)
        return self.attn != "full"

    @property
    def eviction_head(self):  # has the eviction head A, W_δ and its bias (nosa, nosa-hh, dma)
        return self.attn in ("nosa", "nosa-hh", "dma")

    @property
    def heavy_hitters(self):  # E is the attention a block got in the window (nosa-hh: eviction.py)
        return self.attn == "nosa-hh"

    @property
    def G(self):  # query heads per KV head
        return self.H_q // self.H_kv

    @property
    def n_forced(self):  # |F(t)| once the sequence is longer than k blocks
        return self.n_sink + self.n_win + 1

    @property
    def k_q_free(self):  # picks by Q beyond F(t) in this attention mode
        free = {"infllmv2": self.k - self.n_forced, "dma": 0, "full": 0}
        return free.get(self.attn, self.k_q - 1)  # nosa, nosa-hh

    @property
    def n_core(self):  # picks by E beyond F(t): the core (nosa: k_e - n_sink - n_win)
        return self.k - self.n_forced - self.k_q_free

    @property
    def r(self):  # sub-blocks that start in a block (pooling.py)
        return self.B // self.s_c

    @property
    def p(self):  # sub-blocks of the block before that overlap a block
        return (self.l_c - 1) // self.s_c

    @property
    def E_layout(
        self,
    ):  # (r, p) of what a block's E is read from: c̃, or one entry a block (nosa-hh)
        return (1, 0) if self.heavy_hitters else (self.r, self.p)

    @property
    def n_e_list(self):  # the E-list's length (nosa.py's legend): n_core + k_q - 1
        return self.n_core + self.k_q_free if self.eviction_head and self.n_core > 0 else 0

    def n_subblocks(self, T):  # M: the sub-blocks complete after T tokens
        return 0 if T < self.l_c else (T - self.l_c) // self.s_c + 1

    def n_blocks(self, T):  # nb: the (possibly partial) KV blocks T tokens occupy
        return -(-T // self.B)

    @classmethod
    def from_preset(cls, name, **overrides):
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return replace(cls(**PRESETS[name]), **overrides)

    @classmethod
    def from_hf(cls, hf, **overrides):
        """A Hugging Face Llama config.json (dict) -> Config, on the paper's NOSA defaults
        (docs/METHOD.md §2). Keys it leaves out take Hugging Face's documented defaults; anything
        this model does not implement is refused by name rather than silently ignored."""
        for key, ok in (
            ("attention_bias", lambda v: not v),
            ("mlp_bias", lambda v: not v),
            ("hidden_act", lambda v: v == "silu"),
            ("model_type", lambda v: v == "llama"),
        ):
            if key in hf and not ok(hf[key]):
                raise ValueError(
                    f"{key}={hf[key]!r} is not supported by this Llama implementation (no "
                    f"biases, SwiGLU)"
                )
        for key in (
            "num_attention_heads",
            "hidden_size",
            "num_hidden_layers",
            "vocab_size",
            "intermediate_size",
        ):
            v = hf.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{key}={v!r}: a positive integer is needed")
        rope_theta, rope_scaling = rope_from_hf(hf)
        H_q = hf["num_attention_heads"]
        shape = dict(
            vocab_size=hf["vocab_size"],
            n_layer=hf["num_hidden_layers"],
            dim=hf["hidden_size"],
            H_q=H_q,
            H_kv=hf.get("num_key_value_heads") or H_q,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // H_q,
            hidden_dim=hf["intermediate_size"],
            max_seq_len=hf.get("max_position_embeddings", 2048),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
        return cls.from_preset("paper", **{**shape, **overrides})

    def to_dict(self):
        return asdict(self)


def rope_from_hf(hf):
    """(rope_theta, rope_scaling) from a Hugging Face config: the base and scaling at the top level
    (rope_theta, rope_scaling: older tools) or in rope_parameters (current ones). Scalings other
    than linear and llama3 change the computation in ways not implemented here, so they are refused."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    need = {
        "default": (),
        "linear": ("factor",),
        "llama3": (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ),
    }
    if kind not in need:
        raise ValueError(
            f"RoPE scaling rope_type={kind!r} is not implemented (default, linear and llama3 are)"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"partial_rotary_factor={params['partial_rotary_factor']} is not implemented"
        )
    lacking = [key for key in need[kind] if key not in params]
    if lacking:
        raise ValueError(f"RoPE scaling {kind!r} lacks {', '.join(lacking)}")
    scaling = {"rope_type": kind, **{key: float(params[key]) for key in need[kind]}}
    return theta, (None if kind == "default" else scaling)


PRESETS = {
    # the paper's defaults (docs/METHOD.md §2); the transformer has a 1B-scale Llama shape with 16 query heads per KV
    # head, as the authors' kernels assume (a checkpoint's config.json overrides the shape).
    "paper": dict(
        vocab_size=128256,
        n_layer=16,
        dim=2048,
        H_q=32,
        H_kv=2,
        head_dim=64,
        hidden_dim=8192,
        max_seq_len=131072,
        rope_theta=500000.0,
        B=64,
        l_c=32,
        s_c=16,
        n_sink=1,
        n_win=16,
        k=64,
        k_q=16,
    ),
    # CPU demo: k*B = 256 tokens, so sparsity is active from the first quarter of a 1024-token
    # training sequence; same ratios as the paper (k_e / k = 0.75).
    "tiny": dict(),
}
# the paper's sparsity on an 8B-scale Llama shape (Llama 3 8B's widths; 2 KV heads, as the paper's 8B model)
PRESETS["paper-8b"] = dict(
    PRESETS["paper"], n_layer=32, dim=4096, H_q=32, H_kv=2, head_dim=128, hidden_dim=14336
)


def parse_overrides(items):
    """["k=32", "n_layer=6"] -> {"k": 32, "n_layer": 6}, typed like the Config fields."""
    defaults, out = Config(), {}
    for item in items:
        key, eq, val = item.partition("=")
        if not eq:
            raise ValueError(f"--set {item}: write FIELD=VALUE, e.g. --set k=32")
        if key == "attn":
            raise ValueError("--set attn=...: the attention mode has its own flag, --attn")
        if not hasattr(defaults, key) or key.startswith("_"):
            raise ValueError(f"--set {item}: unknown config field {key!r}; see config.Config")
        typ = type(getattr(defaults, key))
        truth = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
        try:
            out[key] = truth[val.lower()] if typ is bool else typ(val)
        except (KeyError, ValueError):
            kind = dict(int="an integer", float="a number", bool="true or false")[typ.__name__]
            raise ValueError(f"--set {item}: {key} takes {kind}") from None
    return out
