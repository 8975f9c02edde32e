from dataclasses import dataclass


@dataclass
class RpcReqInput:
    method: str
    parameters: dict | None = None


@dataclass
class RpcReqOutput:
    success: bool
    message: str


@dataclass
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: list
    load_format: str | None = None
    flush_cache: bool = True
