"""The stand-in's vllm.sampling_params: StructuredOutputsParams as the plain dict of what it was given (logged)."""


class StructuredOutputsParams(dict):
    def __init__(self, **kwargs):
        super().__init__(kwargs)
