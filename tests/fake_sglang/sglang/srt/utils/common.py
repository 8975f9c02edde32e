"""SGLang's weight-update serializer, in the fake: pickled by value (the tests' tensors are on the host)."""

import pickle


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str: bool = False):
        return pickle.dumps(obj)

    @staticmethod
    def deserialize(data):
        return pickle.loads(data)
