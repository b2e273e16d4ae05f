"""A row that cannot enter the contract: the reason code it is quarantined under and the detail shown beside it."""


class RowError(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail
