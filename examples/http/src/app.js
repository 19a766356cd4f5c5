'use strict';
/*
 * app.js: a small payments service that uses the Idempotency-Key middleware.
 *
 *   POST /payments  external-call mode: charges a card at a payment processor
 *                   (the mock in downstream.js) over HTTP.  The key and the
 *                   fencing token travel to the processor, which dedupes by key
 *                   and refuses a token smaller than one it has seen.  Its keys
 *                   are remembered past their retention: a retry that comes
 *                   after the stored response is gone gets a 410, never a
 *                   second charge.
 *   POST /orders    in-transaction mode: the order row is written in the same
 *                   transaction as the claim and the finish.
 *   POST /checkout  two steps, resumable: charge at the processor, then ship
 *                   (a row here).  Each completed step is a checkpoint, so a
 *                   request that takes the key over after a crash resumes
 *                   after the last completed step instead of starting again.
 *   GET  /healthz   liveness.
 *   GET  /metrics   the middleware's answers counted by its hooks, in the
 *                   Prometheus text format (a scrape target as is).
 *
 * The Idempotency-Key handling is the pg-idempotency package's Express
 * middleware (clients/node).  Validation runs before it, so a malformed request
 * gets its 400 without using up the key (the client fixes the body and sends
 * it again with the same key).
 */

const express = require('express');
const { expressIdempotency, rawBody } = require('pg-idempotency');

const PROBLEMS = 'https://payments.example/problems/';

/* RFC 9457 problem details for the service's own errors */
function problemBody(status, type, title, detail) {
	return { type: PROBLEMS + type, title, status, detail };
}

function sendProblem(res, status, type, title, detail) {
	res.status(status).type('application/problem+json')
		.send(JSON.stringify(problemBody(status, type, title, detail)));
}

function badRequest(res, detail) {
	sendProblem(res, 400, 'invalid-request', 'Invalid request', detail);
}

function validatePayment(req, res, next) {
	const b = req.body;
	if (!b || !Number.isInteger(b.amount) || b.amount <= 0)
		return badRequest(res, '"amount" must be a positive integer (minor units).');
	if (typeof b.currency !== 'string' || !/^[A-Z]{3}$/.test(b.currency))
		return badRequest(res, '"currency" must be an ISO 4217 code such as "EUR".');
	return next();
}

/* the processor's key for one of our keys: its namespace is ours, so the tenant is in it */
function processorKey(scope, key) {
	return `${encodeURIComponent(scope)}:${encodeURIComponent(key)}`;
}

/*
 * POST a charge to the processor with its idempotency key and our fencing
 * token.  Resolves to { status, charge } (the processor's answer), or to
 * { unreachable: true } when no answer came: whether it charged is unknown.
 */
async function chargeAtProcessor(downstreamUrl, key, token, { amount, currency }) {
	let answer;
	try {
		answer = await fetch(`${downstreamUrl}/charges`, {
			method: 'POST',
			headers: {
				'content-type': 'application/json',
				'idempotency-key': JSON.stringify(key),
				'fencing-token': token,
			},
			body: JSON.stringify({ amount, currency }),
		});
	} catch {
		return { unreachable: true };
	}
	return { status: answer.status, charge: await answer.json().catch(() => ({})) };
}

/* answer a processor failure with our problem; false when the charge went through */
function sentProcessorProblem(res, result) {
	if (result.unreachable) {
		/* the retry asks again, with the same processor key */
		sendProblem(res, 502, 'processor-unreachable', 'Payment processor unreachable',
			'The payment processor did not answer. Retry with the same Idempotency-Key.');
		return true;
	}
	const { status, charge } = result;
	if (status === 409 && charge.type?.endsWith('/stale-fencing-token')) {
		sendProblem(res, 409, 'stale-attempt', 'Attempt superseded',
			'A newer attempt for this Idempotency-Key reached the processor first.');
		return true;
	}
	if (status >= 500) {
		sendProblem(res, 502, 'processor-unavailable', 'Payment processor unavailable',
			'The payment processor failed. Retry with the same Idempotency-Key.');
		return true;
	}
	if (status >= 400) {
		sendProblem(res, 402, 'payment-declined', 'Payment declined',
			charge.detail ?? `The processor declined the charge (${status}).`);
		return true;
	}
	return false;
}

function validateOrder(req, res, next) {
	const b = req.body;
	if (!b || typeof b.item !== 'string' || b.item.length === 0)
		return badRequest(res, '"item" must be a non-empty string.');
	if (!Number.isInteger(b.quantity) || b.quantity <= 0)
		return badRequest(res, '"quantity" must be a positive integer.');
	return next();
}

/*
 * createApp({ pool, downstreamUrl, lease, retention, remember, faults, pause })
 *   lease, retention: seconds (the middleware's options)
 *   remember: seconds the keys of POST /payments are remembered after their
 *             retention (null: not sent; needs extension 1.7 when set)
 *   faults: honour the X-Simulate-Failure request header (for the tests only)
 *   pause(point, key): what X-Simulate-Failure: pause-after-charge waits for
 */
function createApp({ pool, downstreamUrl, lease, retention, remember = null, faults = false, log, pause }) {
	const app = express();
	app.disable('x-powered-by');
	/* the fingerprint hashes the raw body bytes: keep them */
	app.use(express.json({ verify: rawBody }));

	/* one counter per outcome, fed by the middleware's hooks */
	const answers = { claim: 0, replay: 0, conflict: 0, mismatch: 0, expired: 0, error: 0 };
	const count = (outcome) => () => { answers[outcome] += 1; };

	const options = {
		pool,
		lease,
		retention,
		log,
		onClaim: count('claim'),
		onReplay: count('replay'),
		onConflict: count('conflict'),
		onMismatch: count('mismatch'),
		onExpired: count('expired'),
		onError: count('error'),
		/* tenants: the same key from two clients names two operations */
		scope: (req) => req.get('X-Client-Id') ?? '',
		problemTypeBase: PROBLEMS,
	};
	const idem = expressIdempotency(options);
	/* a charge is never run twice, however late the retry: its keys are remembered */
	const charges = expressIdempotency({ ...options, remember });

	app.get('/healthz', (req, res) => res.json({ ok: true }));

	app.get('/metrics', (req, res) => {
		const lines = ['# HELP idempotency_answers_total Answers of the Idempotency-Key middleware, by outcome.',
			'# TYPE idempotency_answers_total counter'];
		for (const [outcome, n] of Object.entries(answers))
			lines.push(`idempotency_answers_total{outcome="${outcome}"} ${n}`);
		res.type('text/plain; version=0.0.4').send(lines.join('\n') + '\n');
	});

	/*
	 * (a) external call: at least once towards the processor, deduped there.
	 * A 5xx answer releases the key (the retry charges again, deduped by the
	 * processor); a 4xx answer is stored as failed and replayed.
	 */
	app.post('/payments', validatePayment, charges, async (req, res) => {
		const { key, scope, token } = req.idempotency;
		const result = await chargeAtProcessor(downstreamUrl, processorKey(scope, key), token, req.body);
		if (sentProcessorProblem(res, result))
			return;
		const { charge } = result;
		return res.status(201).json({
			payment: `pay_${charge.id}`,
			charge: charge.id,
			amount: charge.amount,
			currency: charge.currency,
			status: 'succeeded',
		});
	});

	/* (b) in-transaction: the order row commits with the stored result, or neither */
	app.post('/orders', validateOrder, idem.transactional, async (req, res) => {
		const { key, client } = req.idempotency;
		const { rows } = await client.query(
			`INSERT INTO orders (request_key, item, quantity)
			 VALUES ($1, $2, $3)
			 RETURNING id, item, quantity, created_at`,
			[key, req.body.item, req.body.quantity]);
		if (faults && req.get('X-Simulate-Failure') === 'after-insert')
			throw new Error('simulated failure after the INSERT');
		const order = rows[0];
		return res.status(201).json({
			order: Number(order.id), item: order.item, quantity: order.quantity,
			created_at: order.created_at.toISOString(),
		});
	});

	/*
	 * (c) two steps that resume: charge at the processor, then ship.  Each
	 * completed step records a checkpoint; the request that takes the key over
	 * after a crash (attempt 2, after the lease) finds the last one in
	 * req.idempotency.phase and phaseData and skips what is done.
	 *
	 *   charge  an external call: at least once, deduped by the processor
	 *           under a key of its own for this step; its checkpoint commits
	 *           right after it ('charge_created', the charge id)
	 *   ship    a row here, committed in one transaction with its checkpoint
	 *           ('shipped'), so it happens exactly once even if the service
	 *           dies before the result is stored
	 */
	app.post('/checkout', validatePayment, idem, async (req, res) => {
		const { key, scope, token, phase, phaseData, checkpoint } = req.idempotency;
		let charge = phaseData?.charge ?? null;
		if (phase === null) {
			const result = await chargeAtProcessor(downstreamUrl,
				`${processorKey(scope, key)}/charge`, token, req.body);
			if (sentProcessorProblem(res, result))
				return;
			charge = result.charge.id;
			await checkpoint('charge_created', { charge });
			if (faults && pause && req.get('X-Simulate-Failure') === 'pause-after-charge')
				await pause('charged', key);
		}
		let shipment = phaseData?.shipment ?? null;
		if (phase !== 'shipped') {
			const client = await pool.connect();
			try {
				await client.query('BEGIN');
				const { rows } = await client.query(
					'INSERT INTO shipments (request_key, charge) VALUES ($1, $2) RETURNING id',
					[key, charge]);
				shipment = Number(rows[0].id);
				await checkpoint('shipped', { charge, shipment }, { client });
				await client.query('COMMIT');
				client.release();
			} catch (err) {
				await client.query('ROLLBACK').then(() => client.release(), (e) => client.release(e));
				throw err;
			}
		}
		return res.status(201).json({ charge, shipment, status: 'shipped' });
	});

	/* a thrown error: a 500 problem, which releases the key (or rolls the transaction back) */
	app.use((err, req, res, next) => {
		if (res.headersSent)
			return next(err);
		(log ?? console.error)('request failed', err);
		return sendProblem(res, 500, 'internal-error', 'Internal server error',
			'The request failed and was not recorded; retry with the same Idempotency-Key.');
	});

	return app;
}

module.exports = { createApp };
