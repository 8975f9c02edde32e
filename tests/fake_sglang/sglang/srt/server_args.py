"""The fake's ServerArgs: the names of the server arguments Rollplex passes, under SGLang 0.5.23's names
(a plain annotated class, as that release's is no dataclass)."""



class ServerArgs:
    model_path: str
    dtype: str = "auto"
    mem_fraction_static: float | None = None
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False
    random_seed: int | None = None
    tp_size: int = 1
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    attention_backend: str | None = None
    mm_attention_backend: str | None = None
    sampling_backend: str | None = None
    disable_cuda_graph: bool = False
    cuda_graph_max_bs_decode: int | None = None
    log_level: str = "info"
