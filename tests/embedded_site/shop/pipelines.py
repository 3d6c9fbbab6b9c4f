"""The shop's pipeline defined in code (ACCS's workflows as code), stored by ``manage.py accs_sync``.

``SHOP_PIPELINE_CARRIER`` stands in for an edit of this file between two deploys: another carrier is
another definition of the ``ship`` step, so the next ``accs_sync`` stores version 2.
"""

import os

from shop.tasks import receipt
from workflows import code

ORDER = {"type": "object", "properties": {"reference": {"type": "string"}, "items": {"type": "integer"},
                                          "carrier": {"type": "string"}}}

pick = code.service("shop-pick", executor="python", executor_config={"callable": "shop.work:pick"},
                    params_schema=ORDER, max_attempts=2)
label = code.service("shop-label", executor="command", params_schema=ORDER, timeout_seconds=30, executor_config={
    "argv": ["python3", "-c", "import json, sys; print(json.dumps(dict(label=sys.argv[1])))", "{reference}"]})
finish = code.service("shop-finish", executor="python", executor_config={"callable": "shop.work:finish"},
                      params_schema=ORDER)

code.workflow("ship-order", description="Pick, label, receipt and close an order.", steps=[
    code.step("pick", pick, default_params={"items": 2}),
    code.step("label", label, depends_on=["pick"]),
    code.step("receipt", receipt, depends_on=["pick"], default_params={"reference": "from-code"}),
    code.step("ship", finish, depends_on=["label", "receipt"],
              default_params={"carrier": os.environ.get("SHOP_PIPELINE_CARRIER", "post")}),
])
