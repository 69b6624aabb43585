from __future__ import annotations

from django.urls import path

from . import views

urlpatterns = [
    path("charge/<int:pk>/", views.charge),
    path("store/<str:store>/<path:key>/", views.store_view),
    path("astore/<str:store>/<path:key>/", views.astore_view),
    path("extending/<str:options>/<str:store>/<path:key>/", views.extending),
    path("callable/<path:key>/", views.by_callable),
    path("custom/<path:key>/", views.custom),
    path("waits/<path:key>/", views.waits),
    path("bad-placeholder/<path:key>/", views.bad_placeholder),
    path("slow/<path:key>/", views.slow),
    path("async/<path:key>/", views.aview),
    path("async-custom/<path:key>/", views.aview_custom),
    path("async-slow/<path:key>/", views.aslow),
    path("mixin/<path:key>/", views.MixinView.as_view()),
    path("mixin-extend/<path:key>/", views.MixinExtendView.as_view()),
    path("mixin-custom/<path:key>/", views.MixinCustomView.as_view()),
    path("async-mixin/<path:key>/", views.AsyncMixinView.as_view()),
    path("decorated/<path:key>/", views.DecoratedView.as_view()),
    path("async-decorated/<path:key>/", views.AsyncDecoratedView.as_view()),
    path("boom/<path:key>/", views.boom),
    path("async-boom/<path:key>/", views.aboom),
    path("transfer/<int:source>/<int:target>/", views.transfer),
    path("async-transfer/<int:source>/<int:target>/", views.atransfer),
    path("mixin-transfer/<int:source>/<int:target>/", views.MixinTransferView.as_view()),
]
