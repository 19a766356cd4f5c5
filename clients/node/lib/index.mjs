// The ESM entry re-exports the CommonJS build, so both entry points share one
// module instance (one set of error classes for instanceof checks).
import cjs from './index.cjs';

export const {
	idempotent,
	idempotentJob,
	currentJob,
	completer,
	expressIdempotency,
	fastifyIdempotency,
	rawBody,
	idempotencyContext,
	parseIdempotencyKey,
	defaultStorePolicy,
	IdempotencyError,
	InProgressError,
	MismatchError,
	ExpiredError,
	StoredFailureError,
	KeyLostError,
	MisconfiguredError,
	MAX_KEY_LENGTH,
	PROBLEMS,
} = cjs;
