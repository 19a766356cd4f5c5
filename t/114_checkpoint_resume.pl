
# Copyright: the idempotency extension authors.
#
# 114_checkpoint_resume.pl: a job of three steps that resumes after a crash
# from its last checkpoint, as an application does it in SQL.  Each step is
# one transaction: the step's business write (a row in public.steps) and
# idem_checkpoint(key, token, step, data).  A successor that takes the key
# over reads the last checkpoint from its claim (phase, phase_data), skips
# the steps already done and runs the rest with the data they left.
#
# What it proves:
#   - an owner whose client is killed (kill -9) after step 1: once the lease
#     has ended, the successor's claim (attempt 2) returns phase step-1 and
#     step 1's data; it runs steps 2 and 3 only, and every step has exactly
#     one business row;
#   - with session-bound claims no lease has to end: a terminated owner is
#     taken over at once, and a checkpoint survives two takeovers in a row
#     (attempt 3 resumes after the step attempt 2 recorded);
#   - a crash (kill -9 of the backend, the server restarts) between a step's
#     business write and its checkpoint, in one transaction: neither
#     survives, the key still shows the step before, and the successor does
#     the lost step exactly once;
#   - the dead owners' tokens are refused (55006) by idem_checkpoint and
#     idem_finish and change nothing; the finished key keeps its last phase
#     in idem_lookup.
#
# Run as described at the top of t/001_restart.pl.  Port 55475 only names
# the socket file.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

# No sweeps: a pending key changes only by the claims below.
my $node = new_node('checkpoint_resume', port => 55475,
	conf => [ 'restart_after_crash = on', 'idempotency.sweep_interval = 0' ],
	extension => 1);

sub sql { return $node->safe_psql('postgres', $_[0]); }

# The business side: one row per step run, by attempt, with the charge the
# step worked on.
sql('CREATE TABLE public.steps (job text, step text, attempt int, charge text)');

my @steps = qw(step-1 step-2 step-3);

# A session that runs a job: its psql and its backend's pid.
sub session
{
	my $s   = $node->background_psql('postgres');
	my $pid = $s->query_safe('SELECT pg_backend_pid()');
	return ($s, $pid);
}

# Claim job $key in session $s (extra idem_claim arguments $args).  Returns
# { outcome, token, attempt, phase, charge } (charge: phase_data->>'charge').
sub claim_job
{
	my ($s, $key, $args) = @_;
	my $line = $s->query_safe(
		    "SELECT concat_ws('|', outcome, token, attempt, coalesce(phase, 'none'), "
		  . "coalesce(phase_data->>'charge', 'none')) "
		  . "FROM idempotency.idem_claim('$key', request => '{\"job\": \"$key\"}'"
		  . ($args ? ", $args" : '') . ')');
	my %c;
	@c{qw(outcome token attempt phase charge)} = split /\|/, $line, -1;
	return \%c;
}

# Step $step of job $key, by the owner $c, in session $s: the business
# write and the checkpoint in one transaction.  Step 1 creates the charge,
# the later ones work on the one the checkpoint carries.
sub run_step
{
	my ($s, $key, $c, $step, $charge) = @_;
	$s->query_safe('BEGIN');
	$s->query_safe("INSERT INTO public.steps VALUES ('$key', '$step', $c->{attempt}, '$charge')");
	$s->query_safe(
		    "SELECT idempotency.idem_checkpoint('$key', $c->{token}, '$step', "
		  . "jsonb_build_object('charge', '$charge'))");
	$s->query_safe('COMMIT');
}

# Run job $key as the owner $c from where its claim says it stopped, up to
# and including step $last (all by default); finish it after the last step.
# Returns the steps it ran.
sub resume
{
	my ($s, $key, $c, $last) = @_;
	$last //= $steps[-1];
	my $charge = $c->{charge} eq 'none' ? "ch-$key" : $c->{charge};
	my $done = $c->{phase} eq 'none';    # no checkpoint: start at step 1
	my @ran;
	foreach my $step (@steps)
	{
		if (!$done)
		{
			$done = 1 if $step eq $c->{phase};
			next;
		}
		run_step($s, $key, $c, $step, $charge);
		push @ran, $step;
		last if $step eq $last;
	}
	$s->query_safe("SELECT idempotency.idem_finish('$key', $c->{token}, 200, "
		  . "jsonb_build_object('charge', '$charge'))")
	  if @ran && $ran[-1] eq $steps[-1];
	return join(',', @ran);
}

# The business rows of job $key: "step:attempt:charge", in step order.
sub business_rows
{
	my ($key) = @_;
	return sql("SELECT string_agg(concat_ws(':', step, attempt, charge), ' ' "
		  . "ORDER BY step, attempt) FROM public.steps WHERE job = '$key'");
}

# "status,attempt,phase" of job $key as idem_lookup reports it.
sub lookup
{
	my ($key) = @_;
	return sql("SELECT concat_ws(',', status, attempt, coalesce(phase, 'none')) "
		  . "FROM idempotency.idem_lookup('$key')");
}

# The old owner $old of job $key is dead: its checkpoint and finish raise
# 55006 and change nothing.
sub dead_token
{
	my ($key, $old, $what) = @_;
	my $row = stored_row($node, 'postgres', '', $key);
	is( sqlstate_of($node, 'postgres',
			"SELECT idempotency.idem_checkpoint('$key', $old->{token}, 'step-9')"),
		'55006', "$what: the dead owner's checkpoint raises 55006");
	is( sqlstate_of($node, 'postgres',
			"SELECT idempotency.idem_finish('$key', $old->{token}, 200)"),
		'55006', "$what: the dead owner's finish raises 55006");
	is(stored_row($node, 'postgres', '', $key), $row, "$what: they changed nothing");
}

###############################################################################
# Killed client, plain claim: the successor comes after the lease
###############################################################################
my ($s, $pid) = session();
my $c = claim_job($s, 'job-a', "lease => '2 seconds'");
is_deeply([ @$c{qw(outcome attempt phase charge)} ], [ 'claimed', 1, 'none', 'none' ],
	'lease: the first owner claims attempt 1, no checkpoint');
is(resume($s, 'job-a', $c, 'step-1'), 'step-1', 'lease: the first owner runs step 1');
is(lookup('job-a'), 'pending,1,step-1', 'lease: lookup shows the checkpoint step-1');

# The client dies before step 2.
$s->{run}->signal('KILL');
eval { $s->{run}->finish; };
ok(backend_gone($node, $pid), 'lease: the first owner\'s backend has ended');
ok(wait_lease_over($node, 'postgres', '', 'job-a'), 'lease: its lease has ended');

my $old = $c;
($s, $pid) = session();
$c = claim_job($s, 'job-a', "lease => '1 hour'");
is_deeply([ @$c{qw(outcome attempt phase charge)} ], [ 'claimed', 2, 'step-1', 'ch-job-a' ],
	'lease: the successor takes over as attempt 2 and gets step 1\'s checkpoint and data');
cmp_ok($c->{token}, '>', $old->{token}, 'lease: with a larger token');
dead_token('job-a', $old, 'lease');
is(resume($s, 'job-a', $c), 'step-2,step-3', 'lease: the successor runs steps 2 and 3 only');
$s->quit;
is(business_rows('job-a'), 'step-1:1:ch-job-a step-2:2:ch-job-a step-3:2:ch-job-a',
	'lease: one business row per step, step 1 not redone, one charge throughout');
is(lookup('job-a'), 'succeeded,2,step-3', 'lease: succeeded at attempt 2, last phase step-3');
$c = claim($node, 'postgres', q{'job-a', request => '{"job": "job-a"}'});
is($c->{outcome} . ',' . $c->{response_code}, 'replay,200', 'lease: a retry replays');

###############################################################################
# Session-bound claims: taken over at once, twice
###############################################################################
($s, $pid) = session();
$c = claim_job($s, 'job-b', "lease => '1 hour', session_bound => true");
is_deeply([ @$c{qw(outcome attempt phase)} ], [ 'claimed', 1, 'none' ],
	'bound: the first owner claims attempt 1');
is(resume($s, 'job-b', $c, 'step-1'), 'step-1', 'bound: the first owner runs step 1');
is(sql("SELECT pg_terminate_backend($pid)"), 't', 'bound: the first owner is terminated');
ok(backend_gone($node, $pid), 'bound: its backend has ended');
eval { $s->quit; };

my $first = $c;
($s, $pid) = session();
$c = claim_job($s, 'job-b', "lease => '1 hour', session_bound => true");
is_deeply([ @$c{qw(outcome attempt phase charge)} ], [ 'claimed', 2, 'step-1', 'ch-job-b' ],
	'bound: the second owner takes over at once, in the first\'s lease, from step 1');
dead_token('job-b', $first, 'bound, first owner');
is(resume($s, 'job-b', $c, 'step-2'), 'step-2', 'bound: the second owner runs step 2');

# The second owner's client dies too.
$s->{run}->signal('KILL');
eval { $s->{run}->finish; };
ok(backend_gone($node, $pid), 'bound: the second owner\'s backend has ended');

my $second = $c;
($s, $pid) = session();
$c = claim_job($s, 'job-b', "lease => '1 hour', session_bound => true");
is_deeply([ @$c{qw(outcome attempt phase charge)} ], [ 'claimed', 3, 'step-2', 'ch-job-b' ],
	'bound: the third owner takes over as attempt 3, from the second\'s step 2');
dead_token('job-b', $first,  'bound, first owner again');
dead_token('job-b', $second, 'bound, second owner');
is(resume($s, 'job-b', $c), 'step-3', 'bound: the third owner runs step 3 only');
$s->quit;
is(business_rows('job-b'), 'step-1:1:ch-job-b step-2:2:ch-job-b step-3:3:ch-job-b',
	'bound: one business row per step, each by the attempt that got to it');
is(lookup('job-b'), 'succeeded,3,step-3', 'bound: succeeded at attempt 3, last phase step-3');

###############################################################################
# A crash between a step's business write and its checkpoint
###############################################################################
($s, $pid) = session();
$c = claim_job($s, 'job-c', "lease => '1 hour', session_bound => true");
is($c->{outcome} . ',' . $c->{attempt}, 'claimed,1', 'crash: the first owner claims attempt 1');
is(resume($s, 'job-c', $c, 'step-1'), 'step-1', 'crash: the first owner runs step 1');

# Step 2's transaction: the business write is made, the checkpoint not yet.
$s->query_safe('BEGIN');
$s->query_safe("INSERT INTO public.steps VALUES ('job-c', 'step-2', 1, 'ch-job-c')");
is($s->query_safe("SELECT count(*) FROM public.steps WHERE job = 'job-c'"), '2',
	'crash: the owner\'s transaction has written step 2');

my $offset = -s $node->logfile;
is(kill('KILL', $pid), 1, 'crash: kill -9 of the owner\'s backend');
# "server process" up to PostgreSQL 17, "client backend" from 18
$node->wait_for_log(
	qr/(?:server process|client backend) \(PID $pid\) was terminated by signal 9.*all server processes terminated; reinitializing.*database system is ready to accept connections/s,
	$offset);
ok($node->poll_query_until('postgres', 'SELECT 1', '1'), 'crash: the server is back');
eval { $s->quit; };

is(business_rows('job-c'), 'step-1:1:ch-job-c',
	'crash: step 2\'s business write did not survive');
is(lookup('job-c'), 'pending,1,step-1', 'crash: the key still shows step 1');

$old = $c;
($s, $pid) = session();
$c = claim_job($s, 'job-c', "lease => '1 hour'");
is_deeply([ @$c{qw(outcome attempt phase charge)} ], [ 'claimed', 2, 'step-1', 'ch-job-c' ],
	'crash: the successor takes over at once (the owner\'s session ended) from step 1');
dead_token('job-c', $old, 'crash');
is(resume($s, 'job-c', $c), 'step-2,step-3', 'crash: the successor runs steps 2 and 3');
$s->quit;
is(business_rows('job-c'), 'step-1:1:ch-job-c step-2:2:ch-job-c step-3:2:ch-job-c',
	'crash: step 2 was done exactly once, by the successor');
is(lookup('job-c'), 'succeeded,2,step-3', 'crash: succeeded at attempt 2, last phase step-3');

$node->stop;
done_testing();
