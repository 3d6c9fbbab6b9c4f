from django.apps import AppConfig


class ShopConfig(AppConfig):
    # The site keeps Django's historical default; ACCS's apps bring their own (BigAutoField).
    default_auto_field = "django.db.models.AutoField"
    name = "shop"
