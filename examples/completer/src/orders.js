'use strict';
/*
 * orders.js: placing an order, in two steps at the payment provider, with a
 * recovery point between them.  One function serves both callers: the
 * POST /orders route (the first attempt, with the client waiting) and the
 * completer (an attempt that takes the key over after the first one died,
 * with the request the claim kept).  Both hand it the attempt: key, scope,
 * fencing token, phase and phaseData (where to resume), checkpoint().
 *
 *   1. authorize  POST /authorizations; then the checkpoint 'authorized'
 *                 with the authorization id, so that no later attempt
 *                 authorizes again
 *   2. capture    POST /captures for that authorization
 *
 * Each call carries an idempotency key of its own (ours and the step's name)
 * and our fencing token: a call repeated after a crash (between the call and
 * its checkpoint) is deduplicated by the provider, and an attempt that lost
 * its key is refused by it.
 */

/* the provider's idempotency key of one step of one of our keys */
function providerKey(scope, key, step) {
	return `${encodeURIComponent(scope)}:${encodeURIComponent(key)}/${step}`;
}

async function call(providerUrl, path, idempotencyKey, token, body) {
	const res = await fetch(providerUrl + path, {
		method: 'POST',
		headers: { 'content-type': 'application/json', 'idempotency-key': idempotencyKey, 'fencing-token': token },
		body: JSON.stringify(body),
	});
	const answer = await res.json();
	if (!res.ok)
		throw new Error(`the provider answered ${res.status} to ${path}: ${answer.title ?? ''} ${answer.detail ?? ''}`);
	return answer;
}

/*
 * placeOrder(attempt, order, { providerUrl, afterCheckpoint }): the order's
 * two steps from where the attempt resumes; resolves to the order as the
 * client gets it.  afterCheckpoint(phase) runs right after a checkpoint is
 * stored (the tests' crash point).
 */
async function placeOrder({ key, scope, token, phase, phaseData, checkpoint }, order,
	{ providerUrl, afterCheckpoint = () => {} }) {
	const { amount, currency } = order;
	let authorization = phaseData?.authorization ?? null;
	if (phase === null) {
		authorization = (await call(providerUrl, '/authorizations', providerKey(scope, key, 'authorize'), token,
			{ amount, currency })).id;
		await checkpoint('authorized', { authorization });
		await afterCheckpoint('authorized');
	}
	const capture = (await call(providerUrl, '/captures', providerKey(scope, key, 'capture'), token,
		{ authorization, amount })).id;
	return { order: key, amount, currency, authorization, capture, status: 'paid' };
}

function validateOrder(order) {
	if (!order || !Number.isInteger(order.amount) || order.amount <= 0)
		return '"amount" must be a positive integer (minor units).';
	if (typeof order.currency !== 'string' || !/^[A-Z]{3}$/.test(order.currency))
		return '"currency" must be an ISO 4217 code such as "EUR".';
	return null;
}

module.exports = { placeOrder, validateOrder };
