"""Sizing and forecasting: the step-time and memory estimator, the layout recommender and the cost-model fit and
validation."""
