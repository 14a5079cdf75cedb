"""The bundled models and data sets: ``models`` (mlp, small_cnn, torchvision's, a small GPT), ``data``
(digits, CIFAR-10, ImageFolder: the image pipelines) and ``text`` (CPython's help texts as byte tokens)."""
