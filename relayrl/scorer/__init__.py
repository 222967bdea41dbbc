"""The scorer role's logic (no gRPC): the models a scorer serves (``models``) and the dynamic batcher that feeds
them requests from many callers together (``batcher``). Its gRPC face is relayrl/services/scorer_server.py."""
