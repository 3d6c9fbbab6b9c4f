"""What the shop's ACCS service runs (a ``python`` service: ``fn(params, ctx)``)."""


def pack(params: dict, ctx) -> dict:
    """Return the packing slip of an order."""
    ctx.log(f"packing {params['reference']}")
    return {"slip": f"SLIP-{params['reference']}"}


def pick(params: dict, ctx) -> dict:
    """Return the items picked for an order."""
    return {"picked": params["reference"], "items": params.get("items", 1)}


def finish(params: dict, ctx) -> dict:
    """Return the closing note of a shipment: its label and receipt from the steps before (ctx.inputs)."""
    receipt = ctx.inputs.get("receipt")  # None when the receipt step was skipped
    return {"closed": params["reference"], "carrier": params.get("carrier", "post"),
            "label": ctx.task_output("label")["label"], "receipt": receipt["return_value"] if receipt else None}
